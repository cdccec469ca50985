"""A verify forward of a whole causal LM without its modules' Python, where its layers all run in one kernel call.

Where all of a model's layers run in one call of the C kernel (`lean_stack._Stack`), a verify forward of a model of
LEAN_MODELS runs its decoder's embedding, mask and rotary embedding, that call, the final norm and the lm_head by
themselves (`_ModelForward`, checked bitwise against the model's own forward once a process). Asked for greedy
choices alone, where the lm_head computes from its tiled copy, it gives each token's argmax from the lm_head's int8
screen (`cpu.Screen`, the same tokens) instead of the logits.

What such checks found holds for the process (`Verdicts`); the tables made of a module's weights (the lm_head's
screen, a rotary module's cos and sin) are kept while the module lives and its weights are unchanged (`Tables`).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from clover_hf import cpu
from clover_hf.core.watch import unchanged, watch
from clover_hf.cpu import BlockMemo

from .architectures import LEAN_MODELS
from .forward import base_forward
from .lean_stack import _Stack

STATIC_ROPE = ("default", "linear", "llama3")  # rope types whose angles do not change with the sequence length
ROTARY_TABLE_MOST = 1 << 14  # positions a rotary table holds at most (2 MiB at head_dim 64 in bf16): past them, the module


class Verdicts:
    """Whether the lean forwards of transformers' classes compute what the classes' own do, found once a process (a
    class does not change within it; another transformers version may change it)."""

    def __init__(self) -> None:
        # (layer class, attention, dtype, device type) -> whether `lean_layers.LeanForward` matched the layer's forward
        self.layers: dict[tuple, bool] = {}
        self.models: dict[tuple, bool] = {}  # (model class, dtype) -> whether `_ModelForward` matched its own forward
        # (model class, dtype[, "top-k"]) -> whether the lm_head's screen chose as its logits do (its argmax, or the
        # columns of a top-k cut)
        self.screens: dict[tuple, bool] = {}


class _RotaryTable(NamedTuple):
    """A rotary module's cos and sin (P, head_dim) of positions 0..P-1, and what they were made of."""

    inv_freq: list  # the module's inv_freq as `heads.watch` saw it
    made: tuple  # (dtype, attention scaling)
    cos: torch.Tensor
    sin: torch.Tensor


class Tables:
    """Tables made of a module's weights, kept while the module lives and made again when its weights change: an
    lm_head's screen (`screen`), a rotary module's cos and sin by position (`rotary_embeddings`)."""

    def __init__(self) -> None:
        self.screens: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # lm_head -> (weights watched, screen)
        self.rotary: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # rotary module -> its `_RotaryTable`

    def screen(self, lm_head: nn.Module) -> cpu.Screen | None:
        """The screen (`cpu.Screen`) of an nn.Linear lm_head's weight, made once (it takes a while) and kept while its
        weight and bias are unchanged (`heads.watch`); None where the kernel does not take it."""
        weight, bias = getattr(lm_head, "weight", None), getattr(lm_head, "bias", None)
        if not isinstance(lm_head, nn.Linear) or weight is None or weight.requires_grad and torch.is_grad_enabled():
            return None
        kept = self.screens.get(lm_head)
        if kept is None or not unchanged(kept[0], [weight, bias]):
            kept = self.screens[lm_head] = ([watch(weight), watch(bias)], cpu.Screen.of(weight.detach(), bias))
        return kept[1]

    def rotary_embeddings(self, rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotary(x, position_ids=positions)`: for a rope type whose angles are fixed (`STATIC_ROPE`), on the CPU, the
        rows of a table the module made of positions 0..P-1 (each position's cos and sin are the same elementwise ops
        of it, whatever the positions beside it: bitwise its own call's). Indexing a table costs a fraction of the
        module's call, which computes every position's angles anew."""
        inv_freq = getattr(rotary, "inv_freq", None)
        if (getattr(rotary, "rope_type", None) not in STATIC_ROPE or not isinstance(inv_freq, torch.Tensor)
                or not x.is_cpu or positions.dim() != 2 or not positions.is_cpu or not positions.numel()):
            return rotary(x, position_ids=positions)
        least, most = (int(t) for t in torch.aminmax(positions))
        if least < 0 or most >= ROTARY_TABLE_MOST:
            return rotary(x, position_ids=positions)
        made = (x.dtype, getattr(rotary, "attention_scaling", None))
        kept = self.rotary.get(rotary)
        if kept is None or kept.made != made or not unchanged(kept.inv_freq, [inv_freq]) or kept.cos.shape[0] <= most:
            with torch.inference_mode(False):  # kept past the call that makes it
                every = torch.arange(1 << max(most, 255).bit_length())[None]
                cos, sin = rotary(torch.empty(1, 1, x.shape[-1], dtype=x.dtype), position_ids=every)
            kept = self.rotary[rotary] = _RotaryTable([watch(inv_freq)], made, cos[0], sin[0])
        return kept.cos[positions], kept.sin[positions]


VERDICTS = Verdicts()  # the process's
TABLES = Tables()  # the process's: a later call of the same model finds its tables made


def lm_head_screen(lm_head: nn.Module) -> cpu.Screen | None:
    """The process's screen of `lm_head` (`Tables.screen`)."""
    return TABLES.screen(lm_head)


def rotary_embeddings(rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary(x, position_ids=positions)`, from the process's table of the module where it has one
    (`Tables.rotary_embeddings`)."""
    return TABLES.rotary_embeddings(rotary, x, positions)


class _ModelForward:
    """A verify forward of a causal LM of LEAN_MODELS whose layers all run in one kernel call (`_Stack`): its decoder's
    embedding, causal mask and rotary embedding as its forward computes them, that call, the final norm (one kernel
    call, its forward made by `make_norm` at the first call that needs it) and the lm_head, without the Python of
    transformers' model forwards, their decorators and the other layers' pass-through calls around them. Its first
    call in a process (per model class and dtype) is checked bitwise against the model's own forward, run after it
    over the same slots of the cache; where they differ (another transformers version) the model's own forward runs
    from then on. What those checks found is kept in `verdicts` (the process's), the lm_head's screen and the rotary
    tables in `tables`."""

    def __init__(self, model: nn.Module, stack: _Stack, make_norm: Callable[[], Callable[[torch.Tensor], torch.Tensor]],
                 verdicts: Verdicts = VERDICTS, tables: Tables = TABLES) -> None:
        self.model, self.stack, self.make_norm, self.verdicts, self.tables = model, stack, make_norm, verdicts, tables
        self.norm: Callable[[torch.Tensor], torch.Tensor] | None = None  # made at the first call that needs it
        self.inner = inner = model.get_decoder()
        self.causal_mask = getattr(sys.modules[type(inner).__module__], "create_causal_mask", None)
        self.parts = (model, inner, inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head)
        self.key = (type(model), inner.norm.weight.dtype)
        self.screens = BlockMemo()  # the lm_head's screen by row count, where its product of those rows is tiled
        # whether the model's mask function returned a 4D mask (a tree's) as given: then later ones skip it (and its
        # checks of the cache, a share of a drafted step)
        self.mask_as_given = False
        # whether the last call made the lm_head's screen or ran a process's first check (of the forward or of the
        # screen): its time is no step's cost (such a step takes several times an ordinary one)
        self.checked = False

    @staticmethod
    def fits(model: nn.Module) -> bool:
        """Whether `model` is one of LEAN_MODELS, transformers' own classes with the parts their forwards use."""
        inner = model.get_decoder() if type(model).__name__ in LEAN_MODELS else None
        return inner is not None and all(hasattr(inner, name) for name in ("embed_tokens", "rotary_emb", "norm")) and (
            type(model).__module__ == type(inner).__module__ == LEAN_MODELS[type(model).__name__])

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, cache, pre_norm: bool,
                 greedy: bool = False, top_k: int | None = None) -> tuple | None:
        """(float32 logits, last hidden states: before the final norm with `pre_norm`, None), or None (nothing done).
        With `greedy`, where the lm_head's screen serves (`_greedy`): (None, hidden states, each token's argmax). With
        `top_k`, where it serves (`_top_k`): (logits (B, T, C) at columns (C,) alone, hidden states, None, columns),
        the columns holding every logit at least its token's k-th largest."""
        self.checked = False
        checked = self.verdicts.models
        if self.causal_mask is None or checked.get(self.key) is False or any(
                part._forward_hooks or part._forward_pre_hooks for part in self.parts):
            return None
        inner, stored = self.inner, getattr(cache, "layers", ())
        length = stored[0].get_seq_length() if stored else 0
        x = inner.embed_tokens(ids)
        if ids.shape[1] == 1 and (mask is None or mask.dim() == 2 and bool(mask.all())):
            # one token of rows without padding sees every key: the mask SDPA skips (a mask of zeros otherwise),
            # which transformers' checks take a share of a one-token forward to find
            causal = None
        elif self.mask_as_given and mask is not None and mask.dim() == 4:
            causal = mask
        else:
            try:
                causal = self.causal_mask(config=inner.config, inputs_embeds=x, attention_mask=mask, cache=cache,
                                          position_ids=positions)
            except TypeError:  # another transformers version's signature
                checked[self.key] = False
                return None
            if mask is not None and mask.dim() == 4:
                self.mask_as_given = causal is mask
        out = self.stack(x, causal, self.tables.rotary_embeddings(inner.rotary_emb, x, positions), cache)
        if out is None:
            return None
        if self.norm is None:
            self.norm = self.make_norm()
        normed = self.norm(out)
        hidden = out if pre_norm else normed
        if greedy and checked.get(self.key):
            targets = self._greedy(normed)
            if targets is not None:
                return None, hidden, targets
        if top_k and checked.get(self.key):
            made = self._top_k(normed, top_k)
            if made is not None:
                return made[1].view(*normed.shape[:2], -1), hidden, None, made[0]
        logits = self.model.lm_head(normed).float()
        if self.key not in checked:
            self.checked = True
            for layer in stored:
                layer.set_length(length)  # the model's own forward writes the same slots again
            own_logits, own_hidden = base_forward(self.model, ids, mask, positions, cache, pre_norm=pre_norm)
            checked[self.key] = torch.equal(own_logits, logits) and torch.equal(own_hidden, hidden)
            if not checked[self.key]:
                warnings.warn(f"clover-hf's lean forward of {type(self.model).__name__} does not match this "
                              "transformers version's; it runs its own forward (slower)", stacklevel=2)
            return own_logits, own_hidden, None
        return logits, hidden, None

    def _greedy(self, normed: torch.Tensor) -> torch.Tensor | None:
        """Each token's greedy choice (B, T) from the lm_head's screen (`cpu.Screen`), the argmax of the
        logits the lm_head computes, where it computes these rows by the kernel's tiled product; else None. Its first
        choices in a process are checked against the whole logits' argmax."""
        targets = self._screened(self.key, normed, lambda screen, x: screen(x),
                                 lambda whole, targets: torch.equal(whole.argmax(-1), targets),
                                 "greedy choice", "its logits' argmax")
        return None if targets is None else targets.view(normed.shape[:2])

    def _top_k(self, normed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(columns (C,), their logits (rows, C)) of the lm_head's screen (`cpu.Screen.top_k`), every logit at
        least its row's k-th largest among them, where it computes these rows by the kernel's tiled product; else None.
        Its first columns in a process are checked against the whole logits."""

        def agrees(whole: torch.Tensor, made: tuple[torch.Tensor, torch.Tensor]) -> bool:
            kept = (whole >= whole.topk(k).values[:, -1:]).any(0).nonzero()[:, 0]
            return bool(torch.isin(kept, made[0]).all()) and torch.equal(whole[:, made[0]], made[1])

        return self._screened((*self.key, "top-k"), normed, lambda screen, x: screen.top_k(x, k), agrees,
                              "top-k columns", "its logits'")

    def _screened(self, key: tuple, normed: torch.Tensor, ask: Callable, agrees: Callable, what: str, against: str):
        """What `ask(screen, rows)` gives of the lm_head's screen for the rows of `normed`, where the lm_head computes
        them by the kernel's tiled product and its screen has not disagreed under `key`; else None. Its first answer
        in a process is checked by `agrees(whole float32 logits (rows, V), answer)`: where that fails, it warns (the
        screen's `what` differed from `against`) and the logits are computed whole from then on."""
        rows, checked = normed.shape[0] * normed.shape[1], self.verdicts.screens
        if checked.get(key) is False:
            return None
        screen = self.screens.get(self.model.lm_head.forward, rows, self._screen)
        made = None if screen is None else ask(screen, normed.reshape(rows, -1))
        if made is None or key in checked:
            return made
        self.checked = True  # the screen made (once a process) and its first answer checked
        checked[key] = agrees(self.model.lm_head(normed).float().reshape(rows, -1), made)
        if not checked[key]:
            warnings.warn(f"clover-hf's {what} from {type(self.model).__name__}'s lm_head screen differed from "
                          f"{against}; the logits are computed whole from now on (slower)", stacklevel=4)
            return None
        return made

    def _screen(self, rows: int) -> cpu.Screen | None:
        """The lm_head's screen where its product of `rows` rows computes from the kernel's tiled copy; else None."""
        bound = self.model.lm_head.forward
        if not isinstance(bound, cpu.BoundLinear) or bound.kernel_weights(rows) is None:
            return None
        return self.tables.screen(self.model.lm_head)
