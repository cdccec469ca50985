"""Clover's draft heads: the Augmenting Block over the accepted positions' features, then per drafted depth the
Regressive Connection (an Attention Decoder) and an output head, whose features the base's lm_head rows score."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from clover_hf.base.architectures import of_model
from clover_hf.base.cache import GrowingLayer
from clover_hf.base.parts import decoder_layers, rms_final_norm
from clover_hf.core.quantized import dense, readable

from .augment import AugmentCache, AugmentLayer
from .base import DraftHeads, document_ids
from .config import CloverConfig
from .decoder import AttentionDecoder, LinearOutputHeads, OutputHead
from .lm_head import DraftLMHead, top_probabilities
from .norm import RMSNorm
from .rope import RotaryTable

if TYPE_CHECKING:
    from .tree import TreeBuffers


class CloverHeads(DraftHeads):
    """All of Clover's trainable parts. Head i drafts the token i+2 positions after the state's token."""

    dynamic_trees = True

    def __init__(self, config: CloverConfig) -> None:
        super().__init__(config)
        # EAGLE-3's fused features: the tapped layers' outputs and the last hidden state, projected to hidden_size
        # (it starts as the last hidden state alone: heads trained without taps carry over)
        taps = len(config.feature_layers or ())
        self.fuse = nn.Linear((taps + 1) * config.hidden_size, config.hidden_size, bias=False) if taps else None
        if self.fuse is not None:
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, taps * config.hidden_size :].copy_(torch.eye(config.hidden_size))
        self.input_decoder = AttentionDecoder(config)
        rotary = RotaryTable(config.head_dim, config.rope_theta)  # one table for all the layers
        self.augment = nn.ModuleList(AugmentLayer(config, rotary) for _ in range(config.num_augment_layers))
        self.augment_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.regressive = AttentionDecoder(config)
        if config.output_head == "linear":
            self.output = LinearOutputHeads(config)
        else:
            self.heads = nn.ModuleList(OutputHead(config) for _ in range(config.num_heads))

    def _head(self, i: int, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Head i's output features from the state s and the embedding e of the token before its own."""
        if self.config.output_head == "linear":
            return self.output(i, s, e)
        return self.heads[i](s, e)

    # -- features -------------------------------------------------------------------------------
    def features(
        self,
        hidden: torch.Tensor,  # (B, T, H) base last hidden states at positions t ((B, T, (taps + 1) H) with taps)
        next_embeds: torch.Tensor,  # (B, T, H) embeddings of tokens t+1
        positions: torch.Tensor,  # (B, T)
        cache: AugmentCache | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, AugmentCache]:
        """Augmenting Block over new positions; returns features (B, T, H) and the cache, extended in place."""
        if self.fuse is not None:
            hidden = self.fuse(hidden)
        x = self.input_decoder(hidden, next_embeds.to(hidden.dtype))
        cache = cache if cache is not None else AugmentCache([GrowingLayer() for _ in self.augment])
        for layer, stored in zip(self.augment, cache.layers):
            x = layer(x, positions, stored, attn_mask)
        return self.augment_norm(x), cache

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Teacher-forced pass for training (a `forward`, so DDP syncs its gradients).

        hidden: (B, T, H) base states at t; next_embeds: (B, T, H) embeddings of x_{t+1}; position_ids
        (B, T), for rows of packed examples, restart at 0 where an example starts (none: one example).
        Returns per head i a (B, T-1-i, H) normed hidden at t = 0..T-2-i whose logits predict x_{t+2+i}.
        """
        B, T, _ = hidden.shape
        if position_ids is None:
            positions, mask = torch.arange(T, device=hidden.device).expand(B, -1), None
        else:  # each packed example attends to itself only: causal within its own block
            docs = document_ids(position_ids)
            causal = torch.ones(T, T, dtype=torch.bool, device=hidden.device).tril()
            positions, mask = position_ids, ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]
        s, _ = self.features(hidden, next_embeds, positions, attn_mask=mask)
        outs = []
        for i in range(self.config.num_heads):
            L = T - 1 - i
            if L <= 0:
                break
            e = next_embeds[:, i : i + L].to(s.dtype)  # e(x_{t+1+i})
            s = s[:, :L] if i == 0 else self.regressive(s[:, :L], e)
            outs.append(self._head(i, s, e))
        return outs

    @torch.no_grad()
    def draft(
        self,
        feature: torch.Tensor,  # (H,) features of the last accepted position
        root: torch.Tensor,  # () the token that follows it (already chosen, not yet verified by the cache)
        tree: "TreeBuffers",
        embed: nn.Module,
        lm_head: DraftLMHead,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft the tree's tokens (num_nodes - 1,), one batched step per depth, and the heads'
        probability of each token at its parent (num_nodes - 1,)."""
        states = feature.view(1, -1)
        e = embed(root.view(1)).to(states.dtype)
        drafted, probs = [], []
        for d, level in enumerate(tree.levels):
            if d > 0:
                states = self.regressive(states[level.parent_of_expanded], e)
            top_p, top = top_probabilities(lm_head(self._head(d, states, e)), level.k)  # (n_expanded, k)
            ids = top if self.draft_token_ids is None else self.draft_token_ids[top]
            children = ids[level.child_parent, level.child_rank]  # (n_level,)
            drafted.append(children)
            probs.append(top_p[level.child_parent, level.child_rank])
            if level.next_expanded is not None:
                e = embed(children[level.next_expanded]).to(states.dtype)
        return torch.cat(drafted), torch.cat(probs)

    @torch.no_grad()
    def draft_dynamic(
        self,
        feature: torch.Tensor,  # (H,)
        root: torch.Tensor,  # ()
        depth: int,
        width: int,
        embed: nn.Module,
        lm_head: DraftLMHead,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Candidates of an EAGLE-2-style tree: at each depth the `width` likeliest paths get `width` children.

        Returns, in drafting order, each candidate's token, parent (candidate index + 1; 0 is the
        root), depth and path log-probability under the heads.
        """
        states = feature.view(1, -1)
        e = embed(root.view(1)).to(states.dtype)
        path_logp = torch.zeros(1, device=feature.device)
        frontier = torch.zeros(1, dtype=torch.long, device=feature.device)  # node ids; the root is 0
        tokens, parents, depths, scores = [], [], [], []
        count = 1
        for d in range(depth):
            if d > 0:
                states = self.regressive(states, e)
            logp = lm_head(self._head(d, states, e)).float().log_softmax(-1)
            top = logp.topk(width, dim=-1)  # (F, width)
            ids = top.indices if self.draft_token_ids is None else self.draft_token_ids[top.indices]
            joint = (path_logp[:, None] + top.values).flatten()
            tokens.append(ids.flatten())
            parents.append(frontier.repeat_interleave(width))
            depths.append(torch.full_like(joint, d + 1, dtype=torch.long))
            scores.append(joint)
            node_ids = count + torch.arange(joint.shape[0], device=feature.device)
            count += joint.shape[0]
            if d + 1 < depth:
                keep = joint.topk(min(width, joint.shape[0])).indices
                states, e = states[keep // width], embed(ids.flatten()[keep]).to(states.dtype)
                path_logp, frontier = joint[keep], node_ids[keep]
        return torch.cat(tokens), torch.cat(parents), torch.cat(depths), torch.cat(scores)

    # -- initialisation ----------------------------------------------------------------------
    @torch.no_grad()
    def init_from_base(self, base_model: nn.Module, norms: bool = False) -> bool:
        """Copy the base's last decoder layer into the Augmenting Block where names and shapes match,
        and with `norms` the base's final norm into the block's final norm (and the linear output
        heads' norm). Clover-2 initialises both this way; returns whether anything was copied.
        """
        layers = decoder_layers(base_model)
        if layers is None:
            return False
        final = rms_final_norm(base_model)
        if norms and final is not None:
            targets = [self.augment_norm] + ([self.output.norm] if self.config.output_head == "linear" else [])
            for norm in targets:
                if norm.weight.shape == final.weight.shape:
                    norm.weight.copy_(final.weight)
        src = dict(layers[-1].named_parameters())
        names = {
            "input_layernorm.weight": "input_layernorm.weight",
            "post_attention_layernorm.weight": "post_attention_layernorm.weight",
            "q_proj.weight": "self_attn.q_proj.weight",
            "k_proj.weight": "self_attn.k_proj.weight",
            "v_proj.weight": "self_attn.v_proj.weight",
            "o_proj.weight": "self_attn.o_proj.weight",
            "gate_proj.weight": "mlp.gate_proj.weight",
            "up_proj.weight": "mlp.up_proj.weight",
            "down_proj.weight": "mlp.down_proj.weight",
        }
        if of_model(base_model).norm_plus_one:  # its norms' weights do not transfer to ours
            names = {k: v for k, v in names.items() if "layernorm" not in k}
        copied = False
        for layer in self.augment:
            own = dict(layer.named_parameters())
            for ours, theirs in names.items():
                if theirs in src and src[theirs].shape == own[ours].shape and readable(src[theirs]):
                    own[ours].copy_(dense(src[theirs]))
                    copied = True
        return copied
