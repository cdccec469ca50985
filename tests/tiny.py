"""Tiny random models, a byte-level tokenizer, and oracle heads for decoding tests."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from clover_hf import CloverForCausalLM, CloverHeads

VOCAB = 256  # one token per byte, so the byte tokenizer below fits every tiny model

_COMMON = dict(bos_token_id=None, eos_token_id=None, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)

# model_type -> config kwargs. Mistral and Gemma3 get windows small enough to be exceeded in tests.
ARCHS: dict[str, dict] = {
    "llama": dict(_COMMON, intermediate_size=128, num_key_value_heads=2),
    "mistral": dict(_COMMON, intermediate_size=128, num_key_value_heads=2, sliding_window=12),
    "qwen2": dict(_COMMON, intermediate_size=128, num_key_value_heads=2),
    "qwen3": dict(_COMMON, intermediate_size=128, num_key_value_heads=2, head_dim=16),
    "gemma3_text": dict(
        _COMMON, intermediate_size=128, num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
    ),
    "phi3": dict(_COMMON, intermediate_size=128, num_key_value_heads=2, pad_token_id=0),
    "gpt2": dict(bos_token_id=None, eos_token_id=None, vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512),
}


def tiny_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs) -> PreTrainedModel:
    """A random model of `model_type` (ARCHS, with `config_kwargs` changed) in eval mode, SDPA attention."""
    from transformers import AutoConfig

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**ARCHS[model_type], **config_kwargs})
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or 0
    return model


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 256-token byte-level tokenizer built offline (no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's byte-to-character map, so that token id == byte value.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    vocab = {chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Token-for-token equality, shapes included."""
    return a.shape == b.shape and bool((a == b).all())


def prompt(seed: int = 1, length: int = 10) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (1, length), generator=g)


class OracleHeads(CloverHeads):
    """Heads that draft the reference continuation along one branch per step, so that long paths,
    non-first branches, partial acceptance and bonus tokens are all exercised.

    For a batch, `reference` holds every row's expected output and `pads` their left padding. A
    prefill call is matched to its row by its tokens (through the base's `embed`); every later call
    extends the Augmenting Block cache its row got last time. Drafts come in the order features were made.
    """

    def __init__(self, config, reference: torch.Tensor, pads: list[int] | None = None, embed=None) -> None:
        super().__init__(config)
        pads = pads or [0] * reference.shape[0]
        self.references = [row[pad:].tolist() for row, pad in zip(reference, pads)]
        self.embed = embed.forward if embed is not None else None  # a function, so not a submodule
        self.row_of: dict[int, tuple[object, int]] = {}  # id(augment cache) -> (the cache, its row)
        self.pending: list[tuple[int, int]] = []  # (row, position) of features not yet drafted from
        self.step = 0

    def features(self, hidden, next_embeds, positions, cache=None, attn_mask=None):
        if cache is None:
            row = self._prefill_row(next_embeds[0])
        else:
            row = self.row_of.pop(id(cache))[1]
        out, new_cache = super().features(hidden, next_embeds, positions, cache, attn_mask)
        self.row_of[id(new_cache)] = (new_cache, row)
        self.pending.append((row, int(positions[0, -1])))
        return out, new_cache

    def _prefill_row(self, next_embeds: torch.Tensor) -> int:
        """The row whose prompt (shifted by one, then its first new token) has these embeddings."""
        if len(self.references) == 1:
            return 0
        length = next_embeds.shape[0]
        rows = [b for b, ref in enumerate(self.references)
                if len(ref) > length and torch.equal(self.embed(torch.tensor(ref[1 : length + 1])), next_embeds)]
        if len(rows) != 1:
            raise AssertionError(f"{len(rows)} reference rows fit a prefill of {length} tokens")
        return rows[0]

    def _truth(self) -> tuple[list[int], int]:
        """The reference of the row being drafted, and its root's position."""
        row, position = self.pending.pop(0)
        return self.references[row], position + 1

    def draft(self, feature, root, tree, embed, lm_head):
        reference, root_pos = self._truth()
        leaves = [p for p in tree.paths if not any(q[: len(p)] == p and len(q) > len(p) for q in tree.paths)]
        target = leaves[self.step % len(leaves)]
        right_depth = 1 + (self.step % (len(target) + 1)) if self.step % 3 else len(target)
        self.step += 1
        out = []
        for p in tree.paths:
            want = root_pos + len(p)
            truth = reference[want] if want < len(reference) else 0
            on_branch = tuple(target[: len(p)]) == tuple(p) and len(p) <= right_depth
            out.append(truth if on_branch else (truth + 1 + p[-1]) % VOCAB)
        probs = [0.9 if tuple(target[: len(p)]) == tuple(p) else 0.1 for p in tree.paths]
        return torch.tensor(out, device=feature.device), torch.tensor(probs, device=feature.device)

    def draft_dynamic(self, feature, root, depth, width, embed, lm_head):
        """The real candidates, re-labelled: one deepest path carries the reference and ranks first."""
        reference, root_pos = self._truth()
        tokens, parents, depths, scores = super().draft_dynamic(feature, root, depth, width, embed, lm_head)
        par, dep = parents.tolist(), depths.tolist()
        deepest = [i for i, d in enumerate(dep) if d == depth]
        node, branch = deepest[self.step % len(deepest)], set()
        while True:
            branch.add(node)
            if par[node] == 0:
                break
            node = par[node] - 1
        right_depth = 1 + (self.step % (depth + 1)) if self.step % 3 else depth
        self.step += 1
        out, new_scores = [], []
        for i, d in enumerate(dep):
            want = root_pos + d
            truth = reference[want] if want < len(reference) else 0
            on_branch = i in branch and d <= right_depth
            out.append(truth if on_branch else (truth + 1 + i) % VOCAB)
            new_scores.append(-0.01 * d if i in branch else float(scores[i]) - 10.0)
        return (torch.tensor(out, device=feature.device), parents, depths,
                torch.tensor(new_scores, device=feature.device))


def oracle_model(base: PreTrainedModel, reference: torch.Tensor, pads: list[int] | None = None,
                 **config_kwargs) -> CloverForCausalLM:
    clover = CloverForCausalLM.from_base(base, **config_kwargs)
    heads = OracleHeads(clover.clover_config, reference, pads, base.get_input_embeddings())
    heads.load_state_dict(clover.clover_heads.state_dict())
    heads.to(device=base.device, dtype=base.dtype)
    model = CloverForCausalLM(base, heads)
    model.budget = "full"  # oracle drafts exercise the verifier on whole trees; budgets are tested on their own
    return model


def left_padded(*prompts: torch.Tensor, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A left-padded batch of (1, L) prompts: (ids, attention_mask, pads per row)."""
    length = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    pads = [length - p.shape[1] for p in prompts]
    for b, (p, pad) in enumerate(zip(prompts, pads)):
        ids[b, pad:] = p[0]
        mask[b, pad:] = 1
    return ids, mask, pads


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tiny_base(directory, model_type: str = "llama") -> str:
    """A tiny random base model with a byte tokenizer and a chat template, saved like a real one."""
    model = tiny_model(model_type)
    model.generation_config.eos_token_id = None
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.pad_token = tok.convert_ids_to_tokens(0)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


def check_stats(stats, new_tokens: int) -> None:
    """A single row's statistics add up: one accepted length per verify step (the prefill yields the
    first token, each verify step its accepted drafts plus one), and the count of new tokens is what
    these produce, the last step possibly cut short by the length limit."""
    accepted = stats.accepted_lengths
    assert stats.new_tokens == new_tokens
    assert len(accepted) == stats.steps - 1
    assert 1 + sum(a + 1 for a in accepted[:-1]) < new_tokens <= 1 + sum(a + 1 for a in accepted)
    assert stats.verified_tokens >= len(accepted) + sum(accepted)  # every accepted draft was verified


def random_heads(base: PreTrainedModel, seed: int = 0, **config_kwargs) -> tuple[CloverForCausalLM, torch.Generator]:
    """Heads (Clover's, or `head_type="medusa"`) with random weights, norms left at one: fresh ones start
    near the identity and draft one token everywhere. Returns the generator too, for further draws."""
    model = CloverForCausalLM.from_base(base, **config_kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.clover_heads.named_parameters():
            if "norm" not in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model, g


class CrossAttentionProjections(torch.nn.Module):
    """q/k/v named like a decoder layer's, its keys and values read from other states than its queries (as Clover's
    attention decoders read them): a group that `linears.shared_input_groups` stacks, then finds taking other inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_proj(x), self.k_proj(states), self.v_proj(states)], dim=-1)


def patch_kernel(monkeypatch, name: str, value) -> None:
    """Set the CPU kernel's `name` to `value` for the test, where the backend's own modules look it up (the kernel
    module) and where the rest of clover_hf does (the `clover_hf.cpu` package)."""
    import clover_hf.cpu
    import clover_hf.cpu.kernel

    monkeypatch.setattr(clover_hf.cpu.kernel, name, value)
    if hasattr(clover_hf.cpu, name):
        monkeypatch.setattr(clover_hf.cpu, name, value)
