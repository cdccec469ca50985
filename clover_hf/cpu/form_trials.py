"""The linear forms learnt from a call's own products, on a machine with none stored.

`linears.faster_forms` times every form apart, before decoding: about as long as a short answer takes to
decode plainly, which that answer never earns back (its first call ran well behind plain `generate`). Here
nothing is timed apart.
Each product of a row count not settled yet is computed in one of the candidate forms in turn and
timed where it runs, inside a real forward; its output is used like any other (every form computes
the same product). The first product of a shape at a row count in a form is not timed (oneDNN builds
its kernel then); a form timed once at NATIVE_BEHIND times another's is not timed again for that shape. Once the
shapes timed `SAMPLES` times in every form hold `COVERAGE` of the weights' bytes, the row count
settles on the form with the least total time over the layers, by `faster_forms`' gain rules.

One row comes first: a call verifies one token a step (in the one-row form, once learnt, already
faster than plain decoding) and computes a prefill in F.linear until it runs ahead of plain `generate`:
the time plain would have taken for the tokens so far (its one-token forward, timed in F.linear by the
one-row trials) less the time the call took. What it is ahead by pays for learning the wider forms
(steps that compute products in forms being timed) and for the weight copies they compute from, one
layer (or one stacked group) at a time, while it stays ahead by RESERVE_STEPS one-token forwards: so a
call ends no slower than plain, whenever it ends. The forms settled are kept after each call, with the
row counts still pending; once every row count of a verify forward (up to PACK_ROWS) settled, the forms
are final. CPU only, as the forms are.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter, defaultdict

import torch
from torch import nn

from .binding import _Stacked
from .layers import _linears, _units, plain_layers, shape_keys, shared_input_groups
from .linears import (
    COPY_GAIN,
    MIN_GAIN,
    NATIVE_BEHIND,
    ONE_ROW_GAIN,
    WeightCopies,
    _candidates,
    copy_nbytes,
    copy_forms_for,
    one_row_forms,
)
from .products import COPIES, LINEAR, MAX_ROWS, NATIVE, PACK_ROWS, WITHOUT_COPY, float16_exact, form_linear

SAMPLES = 3  # timings of each form per weight shape before a row count settles (the least counts: oneDNN's first
# product of a new row count builds its kernel)
COVERAGE = 0.75  # a row count settles once the shapes timed at it hold this share of the weights' bytes (a small
# model's decoder layers' shapes hold somewhat more, its output embedding the rest)
ROW_COUNTS = tuple(1 << k for k in range(MAX_ROWS.bit_length()))  # 1, 2, 4, ... MAX_ROWS
RESERVE_STEPS = 2.0  # a call learns while ahead of plain `generate` by this many of plain's one-token forwards (a
# wide step in forms being timed costs up to about two more than a one-token step)
PLAIN_SHARE = 0.85  # plain's one-token forward counts at this share of its timed time: timed once or twice inside a
# call's own forwards, it had overstated plain `generate`'s by 15%, a lead the call then spent on copies
COPY_BYTES_S = 0.5e9  # how fast weight copies are made, until the trials have timed their own: a copy is made only
# where the call stays ahead by its reserve once the copy is made (an output embedding of a large vocabulary in
# float32, copied at once, had cost a first call more than a second)


def _copies_nbytes(layers: list[nn.Linear], form: str) -> int:
    """Bytes the copies of `layers`' weights for `form` take."""
    return sum(copy_nbytes(m.weight, form) for m in layers)


def row_bucket(rows: int) -> int:
    """The power of two at or below `rows` (at most MAX_ROWS): the row count whose form `rows` takes."""
    return min(1 << (max(rows, 1).bit_length() - 1), MAX_ROWS)


class FormTrials:
    """Each row count's linear form, learnt from the products of the calls that use it.

    `known`: forms settled before (stored for the machine), kept as they are; `pending`: the row counts
    still to learn (default: all). `forms` holds the settled forms other than F.linear, as
    `faster_forms` returns them, and changes in place as row counts settle."""

    def __init__(self, models: list[nn.Module], copies: WeightCopies, known: dict[int, str] | None = None,
                 pending: set[int] | None = None, plain_row_s: float | None = None, fallback: dict[int, str] | None = None,
                 clock=time.perf_counter) -> None:
        self.copies, self.clock = copies, clock
        layers = plain_layers(models)
        self.shape_of = shape_keys(models)
        self._layers = weakref.WeakSet(layers)
        self.layers_of = Counter(self.shape_of.values())  # products of each shape in a forward of all layers
        first = {}
        for m in layers:
            first.setdefault(self.shape_of[id(m)], m.weight)
        self.bytes_of = {key: w.nbytes for key, w in first.items()}
        self.total_bytes = sum(self.layers_of[key] * self.bytes_of[key] for key in first) or 1
        dtype = next(iter(first.values())).dtype if first else torch.float32
        half = dtype in (torch.float16, torch.bfloat16)
        held = 1.0
        if first and "float16_packed" in copy_forms_for(dtype):
            exact = {key: float16_exact(w) for key, w in first.items()}
            held = sum(self.layers_of[k] * self.bytes_of[k] for k, ok in exact.items() if ok) / self.total_bytes
        candidates, copying = _candidates(models, dtype, copies.limit, held)
        # one kind of copy at most, so that trials make copies of one kind only
        candidates = [f for f in candidates if f not in copying or f == copying[0]]
        self.copy_kind = copying[0] if copying else None
        one_row = one_row_forms(candidates, half)
        # ATen's kernel (where oneDNN serves the dtype) at one row only: its products at 2 rows were timed as fast as
        # the blocked layout's inside forwards, yet whole forwards of 2 and 3 tokens ran markedly slower with it (and
        # at tens of rows it took several times oneDNN's time)
        self.candidates = {n: [LINEAR, *(one_row if n == 1 else [f for f in candidates if f != NATIVE])]
                           for n in ROW_COUNTS}
        self.forms: dict[int, str] = dict(known or {})
        self.pending = set(ROW_COUNTS if pending is None else pending)
        self.learnt: set[int] = set()  # row counts settled by these trials in the current call
        self.totals: dict[int, dict[str, float]] = {}  # a learnt row count's ms per form over all the layers
        # a settled row count's best form without a copy (for layers lacking one: all of them in a new process, until
        # the copies are made), learnt or stored (`fallback`)
        self.fallback: dict[int, str] = dict(fallback or {})
        self.ms: dict[tuple[int, tuple], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.seen: dict[int, set[tuple]] = defaultdict(set)
        self.uncopied: set[tuple[tuple, str]] = set()  # (shape, form) whose copy could not be made
        self.timing_copies: list[nn.Linear] = []  # layers given a copy only to be timed (see `_copy`)
        # computed once already, the first not timed: (rows, shape, form) products (each row count of a bucket:
        # at 16-31 rows, the blocked layout's first product at each count had made it look slower than W @ x.T,
        # which then made 16-token verify forwards far slower), and (1, form) one-row forwards
        self.warm: set[tuple] = set()
        groups = shared_input_groups(models)
        self.group_of = {id(m): group for group in groups for m in group}
        # products as `linear_forms` computes them: a group stacked, else a layer
        self.units = _units(models, groups=groups)
        self._copied_all = False  # every unit has its copy for the copy form (or cannot have one)
        self.providing = False  # the call began with copies the settled forms compute from still to make
        self.used: set[int] = set()  # the layers (by id) that computed products here
        self.stacked_products: dict[nn.Linear, _Stacked] = {}  # by a group's first layer, in this call
        self.copied_bytes, self.copying_s = 0, 0.0  # the copies made so far (in any call), and their time
        # products the trials computed (`product`: timed or not, copies made on the way): a step that ran any is no
        # measure of what a step costs
        self.unsettled = 0
        self.started = self.clock()  # when the current call began (`next_call`)
        # seconds of a one-token forward in F.linear, as plain `generate` computes it (timed by the one-row trials,
        # or stored by an earlier process); with the call's prefill and tokens, what plain would have taken
        self.plain_row_s = plain_row_s
        self.prefill_s, self.tokens = 0.0, 0
        # one row is learnt from whole forwards, each in one form (from the base's first product to its output
        # embedding's): per product, W @ x.T was timed faster in float32 on one CPU, yet one-token steps ran slower
        # with it; `faster_forms` times one row streamed for the same reason
        out = models[0].get_output_embeddings() if hasattr(models[0], "get_output_embeddings") else None
        ends = (id(self.units[0][0]), id(out)) if self.units and out is not None else None
        self.row_ends = ends if ends is not None and ends[1] in self.shape_of and ends[0] != ends[1] else None
        self.one_row: dict[str, list[float]] = defaultdict(list)  # seconds of whole one-row forwards per form
        self.forward: tuple[str, float] | None = None  # the form and start of the one-row forward under way

    def serves(self, models: list[nn.Module]) -> bool:
        """Whether these trials were made for the linear layers of `models`."""
        layers = {id(m) for model in models for m in _linears(model)}
        return len(self._layers) == len(self.shape_of) and layers == self.shape_of.keys()  # none freed, none new

    def next_call(self) -> None:
        """A new call starts: the row counts settled so far are the forms' (`linear_forms` computes them, from
        stacked copies where the form has them); these trials compute the pending ones, and every product
        while copies the settled forms compute from are still to be made (`providing`)."""
        self.learnt.clear()
        self.stacked_products = {}
        self.started = self.clock()
        self.prefill_s, self.tokens = 0.0, 0
        self.providing = not self.copied()

    def prefilled(self, seconds: float) -> None:
        """The call's prefill took `seconds`: plain `generate` computes the same one."""
        self.prefill_s += seconds

    def emitted(self, tokens: int) -> None:
        """A step of the call emitted `tokens` tokens: plain `generate` would have run a one-token forward for each."""
        self.tokens += tokens

    def ahead_s(self) -> float | None:
        """Seconds by which the call is ahead of plain `generate`'s time for its prefill and tokens so far (its
        one-token forwards at PLAIN_SHARE of their least timed time); None until plain's one-token forward is
        timed."""
        if self.plain_row_s is None:
            return None
        return self.prefill_s + self.tokens * PLAIN_SHARE * self.plain_row_s - (self.clock() - self.started)

    def _ahead(self) -> bool:
        ahead = self.ahead_s()
        return ahead is not None and ahead >= RESERVE_STEPS * self.plain_row_s

    def may_learn(self) -> bool:
        """Whether the call may spend time on learning (wide steps in forms being timed, prefills in trial forms,
        weight copies): while ahead of plain `generate` by RESERVE_STEPS one-token forwards. A call that never gets
        ahead learns nothing, and runs as plain's forms do: what it learns, it pays for."""
        return self._ahead()

    def handles(self, rows: int) -> bool:
        """Whether these trials compute products of `rows` rows: pending, settled by them in this call, or any
        while `providing` copies; pending row counts above PACK_ROWS (a prefill's) only once the verify forwards'
        forms are `ready` or the call `may_learn` (before, they compute in F.linear, as plain's). A prefill comes
        first in a call, before it may learn: once the verify forms settled, the prefills of later calls learn
        theirs (one prefill a row count; without native bf16 products, F.linear takes several times the
        kernel's tiled copies a row)."""
        n = row_bucket(rows)
        if n > PACK_ROWS and n in self.pending and not (self.ready() or self.may_learn()):
            return False
        return self.providing or n in self.pending or n in self.learnt

    def one_token_steps(self) -> bool:
        """Whether steps should verify one token for now: the forms of wider verify forwards are still to be
        learnt (or the copies they compute from made), and the call may not spend on learning yet
        (`may_learn`). Learning them costs wide steps in forms still being timed and the weight copies, which a
        short answer never earns back; one-token steps in the form learnt for one row already beat plain decoding,
        and what they gain pays for the learning."""
        if 1 in self.pending and self._all_copied():
            # the copies are made, and one row is timed in their form too: from one-token forwards alone (a call that
            # got ahead learnt the wider forms first, and its wide steps would leave one row pending for good)
            return True
        return (self.providing or self._wider_pending()) and not self.may_learn() and not self.ready()

    def width_to_learn(self) -> int | None:
        """The narrowest row count above one a verify forward has (up to PACK_ROWS) still to learn, while the call may
        spend on learning (`may_learn`): a width for a step to verify (the trials run at batch 1); else None."""
        if not self.may_learn():
            return None
        return min((n for n in self.pending if 1 < n <= PACK_ROWS), default=None)

    def _wider_pending(self) -> bool:
        """Whether a verify forward's row count above one (up to PACK_ROWS) is still to be learnt."""
        return any(n in self.pending for n in ROW_COUNTS if 1 < n <= PACK_ROWS)

    def finished(self) -> bool:
        """Whether the verify forwards' forms are final: every row count up to PACK_ROWS settled. Row counts
        above, where still pending, compute in F.linear until a prefill learns them (`handles`)."""
        return 1 not in self.pending and not self._wider_pending()

    def ready(self) -> bool:
        """Whether the forms are final and every copy they compute from is made: steps then cost what they will."""
        return self.finished() and self.copied()

    def copied(self) -> bool:
        """Whether every layer (or stacked group) has the copy its settled forms compute from, or cannot have
        one: products then run as fast as these forms allow."""
        return self.copy_kind not in self.forms.values() or self._all_copied()

    def product(self, layer: nn.Linear, x: torch.Tensor, rows: int) -> torch.Tensor:
        """`layer(x)` for `rows` rows: in the settled form, or in the next form to time (timed)."""
        n, shape = row_bucket(rows), self.shape_of[id(layer)]
        self.used.add(id(layer))
        # in whatever form, computed here a layer at a time (outside the decoder layers' one kernel call), as a step
        # in settled forms does not: one-token steps took about twice as long so
        self.unsettled += 1
        # the copies are made where the forms settled on them, or for one row to be timed in their form: calls that
        # verify one token a step (`budget="one-token"`) have no wider row count to make them, and one row had stayed
        # pending for good (copies never made, never timed), its products in F.linear
        if not self._copied_all and (self.copy_kind in self.forms.values() or (
                n == 1 and 1 in self.pending and self.copy_kind in self._one_row_candidates())):
            self._provide(layer, shape)
        if n in self.learnt or n not in self.pending:
            form = self.forms.get(n, LINEAR)
            return self._compute(layer, x, form, self.fallback.get(n, WITHOUT_COPY.get(form, form)))
        if n == 1 and self.row_ends is not None:
            return self._one_row_product(layer, x)
        self.seen[n].add(shape)
        timed = self.ms[(n, shape)]
        todo = [f for f in self.candidates[n] if not self._done(timed, f) and (shape, f) not in self.uncopied]
        for form in sorted(todo, key=lambda f: len(timed[f])):
            copy = self._copy(layer, form, shape, timing=True) if form in COPIES else None
            if form in COPIES and copy is None:  # not made (yet): time another form
                continue
            if (rows, shape, form) not in self.warm:  # oneDNN builds a kernel for each new shape and row count
                self.warm.add((rows, shape, form))
                return form_linear(x, layer.weight, layer.bias, form, copy)
            start = self.clock()
            out = form_linear(x, layer.weight, layer.bias, form, copy)
            timed[form].append(self.clock() - start)
            if self._done(timed, form):  # the shape may be complete now, and with it the row count
                self._settle(n)
            return out
        # every form timed for this shape (or none can be now): the fastest so far
        best = min((f for f in timed if timed[f]), key=lambda f: min(timed[f]), default=LINEAR)
        return self._compute(layer, x, best, LINEAR)

    def _one_row_candidates(self) -> list[str]:
        """One row's forms: without the copy form once every wider verify row count settled on forms without copies
        (its copies, made for one row alone, would never be made: one row would never settle)."""
        if not self._wider_pending() and self.copy_kind not in self.forms.values():
            return [f for f in self.candidates[1] if f != self.copy_kind]
        return self.candidates[1]

    def _one_row_forms(self) -> list[str]:
        """The forms one row is timed in: the copy form only once every copy is made (a whole forward runs in it)."""
        return [f for f in self._one_row_candidates() if f not in COPIES or self._all_copied()]

    def _one_row_product(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """A one-row product while one row is pending: a forward starting at the base's first layer takes the
        next form to time (each form once untimed first, then SAMPLES times, or once where it takes NATIVE_BEHIND
        times another's time: F.linear's forwards run no faster than plain's), and is timed to the end of its
        output embedding's product; products outside such a forward (the heads') take the fastest so far."""
        first, last = self.row_ends
        if id(layer) == first:
            timed, forms = self.one_row, self._one_row_forms()
            kind = self.copy_kind
            if kind in forms and (1, kind) not in self.warm:
                # the copy form joins once its copies are made: the others are timed again beside it, as the
                # forwards timed before ran over shorter texts
                timed.clear()
            todo = [f for f in forms if not self._done(timed, f)]
            form = min(todo, key=lambda f: len(timed[f]) + ((1, f) in self.warm)) if todo else self._one_row_best()
            self.forward = (form, self.clock())
        form = self.forward[0] if self.forward is not None else self._one_row_best()
        out = self._compute(layer, x, form, LINEAR)
        if id(layer) == last and self.forward is not None:
            form, start = self.forward
            self.forward = None
            if (1, form) not in self.warm:  # the first forward in a form builds kernels and caches
                self.warm.add((1, form))
            elif not self._done(self.one_row, form):
                seconds = self.clock() - start
                self.one_row[form].append(seconds)
                if form == LINEAR:
                    self.plain_row_s = min(seconds, self.plain_row_s or seconds)
                self._settle_one_row()
        return out

    def _one_row_best(self) -> str:
        timed = [f for f in self._one_row_forms() if self.one_row[f]]
        return min(timed, key=lambda f: min(self.one_row[f]), default=LINEAR)

    def _settle_one_row(self) -> None:
        """Settle one row once every form (the copy form too, where one row tries it) is timed enough (`_done`):
        the fastest whole forward, taking at most MIN_GAIN of F.linear's (the copy form, unless wider row counts
        keep its copies already, COPY_GAIN of the best without a copy)."""
        candidates = self._one_row_candidates()
        if any(not self._done(self.one_row, f) for f in candidates):
            return
        ms = {f: 1000 * min(self.one_row[f]) for f in candidates if self.one_row[f]}
        without = min((f for f in ms if f not in COPIES), key=ms.get)
        best = min(ms, key=ms.get)
        # the copies wider row counts compute from, made already, or to be timed by them still: whole forwards timed
        # here understate a copy form's gain (whole forwards from the tiled copies gained little where their products
        # apart gained much), and where one row settles before the wider row counts (calls of one-token steps alone)
        # the copy form had lost on the memory rule below
        kept = best in self.forms.values() or (best == self.copy_kind and self._wider_pending())
        if best in COPIES and not kept and ms[best] > COPY_GAIN * ms[without]:
            best = without
        self.totals[1], self.fallback[1] = ms, without
        self.learnt.add(1)
        self.pending.discard(1)
        if ms[best] < MIN_GAIN * ms[LINEAR]:
            self.forms[1] = best

    def _all_copied(self) -> bool:
        """Whether every layer (or stacked group) that has computed here has its copy for the copy form, or
        cannot have one; False before any has. A layer no call ran (a fourth head under a three-deep
        tree) gets its copy when it first computes, or as a later call's `linear_forms` begins."""
        kind = self.copy_kind
        if not self._copied_all and kind is not None and self.used:
            self._copied_all = all(
                len(unit) > 1 and self.copies.get_fused(unit, kind) is not None
                or all(self.copies.get(m, kind) is not None or (self.shape_of[id(m)], kind) in self.uncopied
                       for m in unit)
                for unit in self.units if any(id(m) in self.used for m in unit))
        return self._copied_all

    def _compute(self, layer: nn.Linear, x: torch.Tensor, form: str, without: str) -> torch.Tensor:
        """`layer(x)` in `form`; one that needs a copy the layer lacks (and cannot get now) in `without`. Layers
        that take one input compute from one stacked copy, as `linear_forms` computes them (made here, so that
        the next call need not make them)."""
        stacked = self._stacked(layer, form) if form in COPIES else None
        if stacked is not None:
            return stacked(layer, x, form)
        copy = self._copy(layer, form, self.shape_of[id(layer)]) if form in COPIES else None
        if form in COPIES and copy is None:
            form = without
        return form_linear(x, layer.weight, layer.bias, form, copy)

    def _provide(self, layer: nn.Linear, shape: tuple) -> None:
        """Make the copy `layer` (its group's stacked one, made as the group's first layer computes) will compute
        from where the forms settled on copies, whatever form this product takes, within the allowance: else
        only wide steps would make them, and the budget, seeing them dear without, might never choose one."""
        kind, group = self.copy_kind, self.group_of.get(id(layer))
        if group is not None and group[0] not in self.copies.apart:
            if layer is group[0] and self.copies.get_fused(group, kind) is None and self._may_copy(list(group), kind):
                self._making(self.copies.prepare_fused, [group], kind)
        elif (self.copies.get(layer, kind) is None and (shape, kind) not in self.uncopied
              and self._may_copy([layer], kind)):
            self._making(self.copies.prepare, [layer], kind)
            if self.copies.get(layer, kind) is None:
                self.uncopied.add((shape, kind))

    def _stacked(self, layer: nn.Linear, form: str) -> _Stacked | None:
        """The product of `layer`'s group (`shared_input_groups`) from its stacked copy, made now where missing,
        when the group's first layer computes and a copy may be made (`_may_copy`)."""
        group = self.group_of.get(id(layer))
        if group is None or group[0] in self.copies.apart:
            return None
        if group[0] not in self.stacked_products:
            entry = self.copies.get_fused(group, form)
            if entry is None and layer is group[0] and self._may_copy(list(group), form):
                self._making(self.copies.prepare_fused, [group], form)
                entry = self.copies.get_fused(group, form)
            if entry is None:
                return None
            self.stacked_products[group[0]] = _Stacked(group, *entry, self.copies.apart)
        return self.stacked_products[group[0]]

    def _copy(self, layer: nn.Linear, form: str, shape: tuple, timing: bool = False) -> torch.Tensor | None:
        """The layer's copy for `form`, made now if missing and one may be made (`_may_copy`). Where one cannot
        be made (no room within the copies' limit, or a weight the form cannot copy), the shape is not timed in
        that form. A layer a stacked copy holds (`linear_forms`) gets one of its own only to be timed (`timing`),
        dropped once its row count settles; such copies are made for a prefill's row count, learnt once the verify
        forms are `ready`, before the call may copy (a few layers' weights a shape)."""
        copy = self.copies.get(layer, form)
        if copy is None and not timing and layer in self.copies.stacked:  # a stacked copy holds its weight
            return None
        if copy is None and (shape, form) not in self.uncopied and (
                self._may_copy([layer], form) or timing and layer in self.copies.stacked and self.ready()):
            self._making(self.copies.prepare, [layer], form)
            copy = self.copies.get(layer, form)
            if copy is None:
                self.uncopied.add((shape, form))
            elif layer in self.copies.stacked:  # a second copy of its weight, for the timing alone
                self.timing_copies.append(layer)
        return copy

    def _may_copy(self, layers: list[nn.Linear], form: str) -> bool:
        """Whether a copy of `layers`' weights for `form` may be made now: where the call stays ahead of plain by its
        reserve once the copy is made, at the rate copies were made so far (COPY_BYTES_S before any was timed)."""
        ahead = self.ahead_s()
        if ahead is None:
            return False
        rate = self.copied_bytes / self.copying_s if self.copying_s > 0 else COPY_BYTES_S
        return ahead - _copies_nbytes(layers, form) / rate >= RESERVE_STEPS * self.plain_row_s

    def _making(self, make, units: list, form: str) -> None:
        """`make(units, form)` (a `WeightCopies.prepare*` of layers, or of groups of them stacked), timed: how fast
        copies are made."""
        start = self.clock()
        make(units, form)
        self.copying_s += self.clock() - start
        self.copied_bytes += _copies_nbytes([m for u in units for m in (u if isinstance(u, tuple) else (u,))], form)

    def _ms(self, n: int, shape: tuple, form: str) -> float:
        """The least time of a product of `shape` at row count `n` in `form`: where the shape takes no copy
        for it, in the form that computes without one (else F.linear)."""
        timed = self.ms[(n, shape)]
        for f in (form, WITHOUT_COPY.get(form, form), LINEAR):
            if timed[f]:
                return min(timed[f])
        return float("inf")

    @staticmethod
    def _done(timed: dict[str, list[float]], form: str) -> bool:
        """Whether `form` is timed enough for a shape: SAMPLES times, or once at NATIVE_BEHIND times the best
        other form's time (ATen's kernel at tens of rows took several times oneDNN's time: a second timing of
        it would cost more than it could tell)."""
        if len(timed[form]) >= SAMPLES:
            return True
        others = [min(ms) for f, ms in timed.items() if f != form and ms]
        return bool(timed[form]) and bool(others) and min(timed[form]) >= NATIVE_BEHIND * min(others)

    def _complete(self, n: int, shape: tuple) -> bool:
        timed = self.ms[(n, shape)]
        return all(self._done(timed, f) for f in self.candidates[n] if (shape, f) not in self.uncopied)

    def _settle(self, n: int) -> None:
        """Settle row count `n` once the shapes timed in every form at it hold COVERAGE of the weights' bytes
        (a shape a forward seldom runs at `n`, as some of the heads' are, need not wait)."""
        shapes = [s for s in self.seen[n] if self._complete(n, s)]
        if sum(self.layers_of[s] * self.bytes_of[s] for s in shapes) < COVERAGE * self.total_bytes:
            return
        forms = self.candidates[n]
        totals = {f: 1000 * sum(self.layers_of[s] * self._ms(n, s, f) for s in shapes) for f in forms}
        without = min((f for f in forms if f not in COPIES), key=totals.get)
        best = min(forms, key=totals.get)
        if best in COPIES and totals[best] > COPY_GAIN * totals[without]:  # not worth the copies' memory
            best = without
        self.totals[n], self.fallback[n] = totals, without
        for layer in self.timing_copies:
            self.copies.discard(layer)
        self.timing_copies.clear()
        self.learnt.add(n)
        self.pending.discard(n)
        if totals[best] < (ONE_ROW_GAIN if n == 1 else MIN_GAIN) * totals[LINEAR]:
            self.forms[n] = best
        kept = self.copy_kind if self.copy_kind in self.forms.values() else None
        if kept is not None:  # copies made for one row count serve every other they were timed faster at
            for m, ms in self.totals.items():
                if m > 1 and ms[kept] < ms[self.forms.get(m, LINEAR)]:
                    self.forms[m] = kept
