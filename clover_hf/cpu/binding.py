"""Linear layers bound to their forms within a block (`linear_forms`), and what the kernel's callers ask of them.

Within the block each plain nn.Linear's `forward` is a `BoundLinear`: an object, so that the C kernel's callers
(a decoder layer in one call, the heads' drafting, the lm_head's screen) can ask it which tiled copy a row count
computes from (`kernel_weights`, `layer_weights`) and in which form (`BlockMemo`), instead of reading attributes off
a function. Layers that take one input compute in one product of their stacked weights (`_Stacked`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from .layers import _units, plain_layers, shared_input_groups
from .linears import WeightCopies, copy_form
from .products import PACK_ROWS, TILED, LinearForms, form_for, form_linear, form_product


class Trials(Protocol):
    """What a block asks of the form trials (`form_trials.FormTrials`) that compute the row counts still to learn."""

    def ready(self) -> bool: ...

    def handles(self, rows: int) -> bool: ...

    def product(self, layer: nn.Linear, x: torch.Tensor, rows: int) -> torch.Tensor: ...


class _Stacked:
    """One group's product: its first layer computes every member's output from the stacked copy and
    keeps the others' for them, as long as they are called with that same input. A member called with
    another input (an attention whose keys read other states than its queries) computes on its own,
    and so does the whole group from then on; `apart` remembers it, so later blocks keep the layers'
    own copies. A member called while none of the first layer's outputs is kept (its product ran elsewhere:
    the form trials time a row count's first products apart, and it can settle between a layer's q and k)
    computes on its own without that verdict: taking it for another input had split groups at random in a
    process's first calls, and with them every later verify forward of the process out of the decoder layers'
    one kernel call."""

    def __init__(self, group: tuple[nn.Linear, ...], copy: torch.Tensor, bias: torch.Tensor | None,
                 apart: weakref.WeakSet) -> None:
        self.first, self.copy, self.bias, self.apart = group[0], copy, bias, apart
        self.alone = False  # a member took another input: the group computes apart for the rest of the block
        self.sizes = [m.out_features for m in group]
        self.ids = [id(m) for m in group]
        self.input: torch.Tensor | None = None
        self.outputs: dict[int, torch.Tensor] = {}

    def __call__(self, layer: nn.Linear, x: torch.Tensor, form: str) -> torch.Tensor:
        if self.alone:
            return form_linear(x, layer.weight, layer.bias, form)  # without a copy until the next block
        if layer is self.first:
            return self._split(x, form_linear(x, None, self.bias, form, self.copy))
        if x is self.input and id(layer) in self.outputs:
            return self._take(id(layer))
        if self.outputs:  # the first layer's product of another input waits for this member
            self.alone = True
            self.apart.add(self.first)
            self.input, self.outputs = None, {}
        return form_linear(x, layer.weight, layer.bias, form)

    def _split(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The first layer's part of the group's product `out` of `x`; the others' are kept for them."""
        parts = torch.split_with_sizes(out, self.sizes, -1)  # Tensor.split's Python wrapper costs more a call
        self.input, self.outputs = x, dict(zip(self.ids[1:], parts[1:]))
        return parts[0]

    def _take(self, key: int) -> torch.Tensor:
        """A member's kept output, handed over once; the input is let go with the last."""
        out = self.outputs.pop(key)
        if not self.outputs:
            self.input = None
        return out

    def member(self, layer: nn.Linear, form: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """`layer`'s product in `form`, as `__call__` computes it, with what can be looked up once bound."""
        if layer is self.first:
            compute = form_product(form, None, self.bias, self.copy)
            return lambda x: self(layer, x, form) if self.alone else self._split(x, compute(x))
        key = id(layer)

        def sibling(x: torch.Tensor) -> torch.Tensor:
            if x is self.input and not self.alone and key in self.outputs:
                return self._take(key)
            return self(layer, x, form)

        return sibling


class _Block:
    """What one `linear_forms` block binds its layers' forwards to: the forms, the copies they compute from (each
    layer's own in `made`, the stacked groups' in `stacked`, both by the layer's id; `kind` the form that uses them),
    and the trials that compute the row counts still to learn."""

    def __init__(self, forms: dict[int, str], kind: str | None, stacked: dict[int, _Stacked],
                 made: dict[int, torch.Tensor | None], trials: Trials | None) -> None:
        self.forms, self.kind, self.stacked, self.made, self.trials = forms, kind, stacked, made, trials
        # trials ready as the block starts stay so, and leave the verify forwards' row counts to the forms: only a
        # prefill's may still be theirs to learn (asking them would cost a call a product)
        self.verify_settled = trials is None or trials.ready()

    def tried(self, rows: int) -> bool:
        """Whether the trials compute this block's products of `rows` rows."""
        trials = self.trials
        return trials is not None and (rows > PACK_ROWS or not self.verify_settled) and trials.handles(rows)

    def product(self, m: nn.Linear, form: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """How `m` computes in `form` in this block."""
        if form == self.kind and id(m) in self.stacked:
            return self.stacked[id(m)].member(m, form)
        return form_product(form, m.weight, m.bias, self.made.get(id(m)) if form == self.kind else None)


class BoundLinear:
    """A plain linear layer's `forward` within a `linear_forms` block: each input computes in the form the block
    gives its row count, that row count's product looked up once (`__call__`), or by the block's trials where they
    handle it. The kernel's callers ask it which tiled copy a row count computes from (`kernel_weights`) and in which
    form (`form_of`); `steady_rows`: up to which row count those answers hold all block."""

    def __init__(self, layer: nn.Linear, block: _Block) -> None:
        self.layer, self.block = layer, block
        self.steady_rows = PACK_ROWS if block.verify_settled else 0
        self._trials, self._verify_settled = block.trials, block.verify_settled  # read at every product
        self._by_rows: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._by_form: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._biases: dict[int, torch.Tensor] = {}  # float32 copies of the biases handed out, by the bias's id

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() >= 2 else 1
        trials = self._trials
        if trials is not None and (rows > PACK_ROWS or not self._verify_settled) and trials.handles(rows):
            return trials.product(self.layer, x, rows)
        compute = self._by_rows.get(rows)
        if compute is None:
            form = form_for(self.block.forms, rows)
            compute = self._by_form.get(form)
            if compute is None:
                compute = self._by_form[form] = self.block.product(self.layer, form)
            self._by_rows[rows] = compute
        return compute(x)

    def form_of(self, rows: int) -> str:
        """The form of a row count in this block."""
        return form_for(self.block.forms, rows)

    def kernel_weights(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None, list[int]] | None:
        """The tiled copy (`bf16_kernel.tile`) and bias (float32) the layer's products of `rows` rows compute from
        here, stacked with its group's where it leads one, and the output sizes of the layers it holds; None where
        they compute otherwise (no copy, a trial, a group computing apart, or a group's other member; past PACK_ROWS,
        another form). A verify forward's row counts take the copy whatever form they settled on: the forms were
        timed product by product, and the kernel's one call for all of a forward's layers (or a draft's levels)
        saves more than any form gained."""
        block, m = self.block, self.layer
        if block.kind != TILED or (rows > PACK_ROWS and form_for(block.forms, rows) != TILED) or block.tried(rows):
            return None
        group = block.stacked.get(id(m))
        if group is not None:
            if group.alone or group.first is not m:
                return None
            copy, bias, sizes = group.copy, group.bias, group.sizes
        else:
            copy, bias, sizes = block.made.get(id(m)), m.bias, [m.out_features]
        if copy is None:
            return None
        if bias is not None and id(bias) not in self._biases:
            self._biases[id(bias)] = bias.detach().float().contiguous()
        return copy, None if bias is None else self._biases[id(bias)], sizes


def kernel_weights(layer: nn.Linear, rows: int, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Within `linear_forms`: the tiled copy (`bf16_kernel.tile`) and float32 bias `layer`'s products of `rows` rows
    compute from (`BoundLinear.kernel_weights`), where they hold the outputs of `sizes` (its own, or its stacked
    group's); else None."""
    bound = layer.forward
    found = bound.kernel_weights(rows) if isinstance(bound, BoundLinear) else None
    return found[:2] if found is not None and found[2] == sizes else None


def layer_weights(rows: int, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear, gate: nn.Linear, up: nn.Linear,
                  down: nn.Linear) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
    """The tiled copies and biases (`kernel_weights`) a Llama-pattern layer's products of `rows` rows compute from, as
    `bf16_kernel.DecoderLayer` takes them: q/k/v stacked, o, gate/up stacked, down; None where any computes
    otherwise."""
    weights = [kernel_weights(first, rows, [m.out_features for m in group])
               for first, group in ((q, (q, k, v)), (o, (o,)), (gate, (gate, up)), (down, (down,)))]
    return None if any(w is None for w in weights) else weights


class BlockMemo:
    """Weights looked up for a row count (`kernel_weights`, `layer_weights`) within one block of linear forms: kept
    for the row counts whose forms hold all block (`BoundLinear.steady_rows`), one lookup per form (the row counts of
    a form compute from the same copies), forgotten when another block binds. Drafted steps change width every few
    steps: looking the weights up again at each, or once per width a call, cost a share of a drafted step."""

    def __init__(self) -> None:
        self.bound: BoundLinear | None = None  # the forward the weights kept were looked up under
        self.found: dict[str, object] = {}

    @staticmethod
    def steady_form(forward: object, rows: int) -> str | None:
        """The form `rows` rows compute in, where `forward` (a layer's `forward`) is a `BoundLinear` whose answer for
        them holds all block (`steady_rows`); else None."""
        if isinstance(forward, BoundLinear) and rows <= forward.steady_rows:
            return forward.form_of(rows)
        return None

    def get(self, forward: object, rows: int, look: Callable[[int], object | None]) -> object | None:
        """What `look(rows)` gives (None: nothing to keep), looked up once per form within the block that bound
        `forward` (a layer's `forward`, a `BoundLinear` within a block): `look` must depend on `rows` only through the
        form the block gives them."""
        form = self.steady_form(forward, rows)
        if form is None:
            return look(rows)
        if forward is not self.bound:
            self.bound, self.found = forward, {}
        value = self.found.get(form)
        if value is None:
            value = look(rows)
            if value is not None:
                self.found[form] = value
        return value


def _stacked_groups(models: list[nn.Module], copies: WeightCopies | None, kind: str | None,
                    trials: Trials | None) -> dict[int, _Stacked]:
    """Each layer (by id) of a group that takes one input (`shared_input_groups`) whose stacked copy for `kind` is made,
    and the group's product; the copies made here first where `trials` leave them to the forms (none, or ready: the
    forms' copies are made but for layers no call ran yet, Clover's heads after a first call of one-token steps, which
    get theirs now). Trials still learning make them as the call can afford them, but the layers of a group seen taking
    other inputs get their own now (else they computed without copies while trials lived); a few small layers."""
    stacked: dict[int, _Stacked] = {}
    if copies is None or kind is None:
        return stacked
    groups = shared_input_groups(models)
    units = _units(models, copies.apart, groups)
    if trials is None or trials.ready():
        copies.prepare_units(units, kind)
    else:
        copies.prepare_units([(m,) for g in groups if g[0] in copies.apart for m in g], kind)
    for group in (u for u in units if len(u) > 1):
        entry = copies.get_fused(group, kind)
        if entry is not None:
            stacked |= dict.fromkeys((id(m) for m in group), _Stacked(group, *entry, copies.apart))
    return stacked


@contextlib.contextmanager
def linear_forms(models: Iterable[nn.Module], forms: LinearForms, copies: WeightCopies | None = None,
                 trials: Trials | None = None) -> Iterator[None]:
    """Within the block, the models' plain nn.Linear layers compute in the form `forms` gives each
    input's row count (their `forward` a `BoundLinear`); forms that compute from a weight copy take it from
    `copies` (made there as the block starts, where missing; without `copies`, or where one would not fit, they
    compute without one). There, layers that take one input (`shared_input_groups`: a decoder layer's q/k/v and
    gate/up projections) compute in one product from a copy of their weights stacked: fewer, larger products.
    Each layer's copy and each row count's form are looked up once, as the block starts (checking a copy
    against its weight at every product cost a share of a verify forward): the weights must not change within
    the block, as they do not within a `generate` call.
    `trials` (`form_trials.FormTrials`): products of the row counts it has still to learn (or learnt
    within the block) are computed and timed by it instead, and it makes the copies missing."""
    if not forms and trials is None:
        yield
        return
    models = list(models)
    forms = dict(forms)
    layers = plain_layers(models)  # a layer listed twice once
    kind = copy_form(forms)
    stacked = _stacked_groups(models, copies, kind, trials)
    made = ({} if copies is None or kind is None
            else {id(m): copies.get(m, kind) for m in layers if id(m) not in stacked})
    block = _Block(forms, kind, stacked, made, trials)
    for m in layers:
        m.forward = BoundLinear(m, block)
    try:
        yield
    finally:
        for m in layers:
            del m.forward
