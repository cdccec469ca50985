"""The draft budget: each step, verify only the drafted nodes that pay on the machine at hand.

- `DraftBudget`: what the per-step choice keeps across `generate` calls of one model: the verify costs per
  machine (`costs.CostModel`, loaded from and saved to the user cache), acceptance per decoding mode
  (`acceptance.AcceptanceModel`), a heads gate per batch size and tree, and what backends keep across calls
  (the CPU kernel's linear forms and weight copies).
- `HeadsGate`: stops drafting with the heads while that does not pay for its own cost, and tries again
  after a pause.

Each step's width is chosen in `widths.choose_width`: a width the budget stopped choosing is never timed
again, so its estimate could stay wrong for good (a stall, or a machine that got faster): the longer a width
goes untimed, the cheaper it is assumed to be when choosing, until it is tried once more.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable

from .acceptance import AcceptanceModel
from .costs import CostModel, load_costs, save_costs

MIN_PAUSE, MAX_PAUSE = 4, 256  # steps without the heads after drafting did not pay; doubles while it still does not
# drafting steps whose mean gain decides, at first and after each pause: one step where the lookup chain alone did
# well (its text copying earlier text) must not pause heads that pay on average
PROBE_STEPS = 4
# the heads pause only where their estimated rate falls this share below the lookup chain's alone: a pause costs what
# the estimate leaves out (the Augmenting Block catching up when drafting resumes, the judging steps)
PAUSE_MARGIN = 0.1
# a pause lasts long enough that the next judgement's drafting costs at most this share of the paused steps' time:
# a batch's rows draft one by one, so judging heads that never pay can cost a good share of a call
PROBE_SHARE = 0.1
# Steps whose positions the Augmenting Block catches up on when the heads draft again after a pause: over all
# of a pause of hundreds of steps, each retry would cost a good share of what the pause saved. Its attention
# then skips the older positions (the prompt's too, when the pause began in an earlier call): drafts lose
# accuracy where the heads were not paying anyway, verification stays exact.
CATCH_UP_STEPS = 32
FULL_DEPTH_EVERY = 8  # of drafting steps, those that draft the tree's full depth whatever was used before


@dataclass
class HeadsGate:
    """Whether to draft with the heads this step: not while recent steps say drafting costs clearly
    more time than the tokens it adds are worth (PAUSE_MARGIN); after a pause (doubling while that
    holds, halving with each drafting step that pays) it tries again, judging afresh over PROBE_STEPS
    drafting steps.
    And how deep: one level below the deepest drafted node the last drafting step verified (each
    level costs a head pass), the tree's full depth now and then."""

    draft_ms: float | None = None  # running cost of drafting a tree
    augment_ms: float = 0.0  # running cost of the Augmenting Block per accepted position (paid only to draft)
    gain: float | None = None  # running (tokens/ms with the heads) / (tokens/ms with the lookup chain alone) - 1
    pause: int = 0
    next_pause: int = MIN_PAUSE
    # weight of each drafting step in the running figures: a gain estimated step by step is noisy, and a heavier
    # weight let its running mean dip below zero often enough to pause heads that paid
    smoothing: float = 0.1
    depth: int | None = None  # drafting depth; None: the tree's own
    drafted: int = 0
    probe: list[float] = field(default_factory=list)  # gains of the drafting steps since it began judging afresh
    unsettled: bool = False  # judged on steps whose linear forms were still being learnt (`restart` once settled)
    hopeless: bool = False  # drafting costs more than the steps its deepest draft could save (`beyond_gain`)
    dear: int = 0  # drafting steps in a row that cost more than that

    def restart(self) -> None:
        """Forget what was judged while the linear forms were being learnt: their steps (and drafting) cost more
        than they will, and pauses doubled on them would keep the heads from drafting in the next calls."""
        self.draft_ms, self.augment_ms, self.gain, self.probe = None, 0.0, None, []
        self.pause, self.next_pause, self.depth, self.unsettled, self.hopeless = 0, MIN_PAUSE, None, False, False
        self.dear = 0

    def beyond_gain(self, draft_ms: float, steps_saved: int, step_ms: float) -> None:
        """Drafting steps whose drafting alone (`draft_ms`) cost more than the one-token steps (`step_ms` each) that
        its deepest draft would save were all of it accepted (`steps_saved`): the heads can never pay (untrained
        heads drafting from a large vocabulary). They pause at once for as long as a pause lasts, and steps that
        explore wider widths take the lookup chain alone, rather than judging the heads over more drafting steps,
        each dearer than what plain decoding would have done in the time. Two such steps in a row: a process's
        first draft also makes what the heads compute from (weight copies, tables), which later drafts do not. Once
        the gate has a running cost of drafting, a step counts at most that: two stalls in a row of one-level drafts
        (each dear beside the one step it could save) had paused heads that paid for as long as a pause lasts."""
        if self.draft_ms is not None:
            draft_ms = min(draft_ms, self.draft_ms)
        self.dear = self.dear + 1 if draft_ms > steps_saved * step_ms else 0
        if self.dear >= 2:
            self.hopeless, self.gain, self.probe = True, None, []
            self.pause = self.next_pause = MAX_PAUSE

    def drafting(self) -> bool:
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def draft_depth(self, full: int) -> int:
        """How deep to draft this step, for a tree `full` levels deep."""
        self.drafted += 1
        if self.depth is None or self.drafted % FULL_DEPTH_EVERY == 0:
            return full
        return min(self.depth, full)

    def used(self, deepest: int) -> None:
        """The deepest drafted node a drafting step verified (0: none)."""
        self.depth = deepest + 1

    def drafting_ms(self, draft_ms: float, augment_ms: float) -> float:
        """What drafting a tree costs a step: the running cost, else this step's (`draft_ms`, and the Augmenting
        Block's `augment_ms` per position, for the one position a step accepts at the least)."""
        if self.draft_ms is None:
            return draft_ms + augment_ms
        return self.draft_ms + self.augment_ms

    def record(self, draft_ms: float, augment_ms: float, tokens: float, verify_ms: float, rate_without: float) -> None:
        """One drafted step: its drafting time and the Augmenting Block's per position, and the
        expected tokens and predicted ms of the chosen width, against the best expected rate of the
        lookup chain alone."""
        if self.draft_ms is None:
            self.draft_ms, self.augment_ms = draft_ms, augment_ms
        else:
            self.draft_ms += self.smoothing * (draft_ms - self.draft_ms)
            self.augment_ms += self.smoothing * (augment_ms - self.augment_ms)
        rate = tokens / (verify_ms + self.draft_ms + self.augment_ms * tokens)
        gain = rate / rate_without - 1 if rate_without > 0 else 1.0
        if self.gain is None:  # judged afresh: one step whose lookup chain alone did well must not decide
            self.probe.append(gain)
            if len(self.probe) < PROBE_STEPS:
                return
            self.gain, self.probe = sum(self.probe) / len(self.probe), []
        else:
            self.gain += self.smoothing * (gain - self.gain)
        if self.gain < -PAUSE_MARGIN:
            judging = math.ceil(PROBE_STEPS * (self.draft_ms + self.augment_ms) / (PROBE_SHARE * verify_ms))
            self.pause = min(max(self.next_pause, judging), MAX_PAUSE)
            self.next_pause = min(2 * self.pause, MAX_PAUSE)
            self.gain = None  # judged afresh after the pause
        else:  # halved, not reset: one lucky retry where the heads hardly ever pay must not bring back frequent ones
            self.next_pause = max(self.next_pause // 2, MIN_PAUSE)


class DraftBudget:
    """What the per-step choice keeps across `generate` calls of one model: verify costs per machine
    (loaded from and saved to the user cache) and acceptance per decoding mode.

    `costs` fixes the cost model (nothing is measured, refined or saved: with its `draft_ms` set,
    the choices are the same on every run); `cache_dir` overrides where costs are kept (default:
    `$CLOVER_HF_CACHE` or ~/.cache/clover_hf).

    `weight_copies`: the memory the CPU kernel's linear forms may spend on copies of the base's weights made
    once (`backends.kernel_forms.FormBook`). True: at most half the memory available when they are made; an
    int: at most that many bytes; False: none. `forms`: with fixed `costs`, how the kernel's linear layers
    multiply each row count (`clover_hf.cpu.LinearForms`; None: F.linear throughout). `widest`: verify at most
    this many tokens per row each step (1: plain decoding steps in Clover's kernels, no drafting: what
    speculation adds is measured against it).
    """

    def __init__(self, costs: CostModel | None = None, cache_dir: str | Path | None = None,
                 weight_copies: bool | int = True, widest: int | None = None, forms: dict[int, str] | None = None
                 ) -> None:
        if isinstance(weight_copies, int) and not isinstance(weight_copies, bool) and weight_copies < 0:
            raise ValueError(f"weight_copies must be True, False or a number of bytes >= 0, got {weight_copies}")
        if widest is not None and widest < 1:
            raise ValueError(f"widest must be at least 1 (a plain decoding step), got {widest}")
        self.fixed = costs
        self.cache_dir = cache_dir
        self.weight_copies = weight_copies
        self.forms = forms
        self.widest = widest
        self.cut = True  # False: the whole tree every step, in this budget's linear forms (`whole_tree`)
        self._costs: dict[str, CostModel] = {}
        self._acceptance: dict[tuple, AcceptanceModel] = {}
        self._gates: dict[int, HeadsGate] = {}
        self._kept: dict[str, object] = {}  # what backends keep across calls (`kept`)

    @property
    def gate(self) -> HeadsGate:
        """The heads gate of one-row calls (`gate_for`)."""
        return self.gate_for(1)

    def gate_for(self, rows: int, setting: Hashable | None = None) -> HeadsGate:
        """The heads gate of calls that start with `rows` rows and draft with `setting` (the caller's tree and
        chain; None: the heads' own). Whether drafting pays differs with the batch (a batch's rows draft one by
        one, and its steps count the tokens of its last row): heads that never pay at several rows grow long
        pauses, which a shared gate would carry into the next one-row call. And with the tree: calls alternating
        trees on one gate drafted far less often than one tree alone."""
        return self._gates.setdefault((rows, setting), HeadsGate())

    def one_token(self) -> "DraftBudget":
        """This budget verifying one token a step: the same costs, forms and weight copies (shared, not copied)."""
        return self._view(widest=1)

    def _view(self, **changes) -> "DraftBudget":
        view = copy.copy(self)  # shallow: the costs, acceptance, gates and weight copies stay this budget's
        view.__dict__.update(changes)
        return view

    def whole_tree(self) -> "DraftBudget":
        """This budget verifying the whole tree every step, in its linear forms and weight copies (shared)."""
        return self._view(cut=False)

    def kept(self, name: str, make: Callable[[], object]) -> object:
        """What a backend keeps across the calls of this budget's model under `name` (`make()` at first use), shared
        by the budget's views (the CPU kernel's forms: `backends.kernel_forms.FormBook`)."""
        if name not in self._kept:
            self._kept[name] = make()
        return self._kept[name]

    def acceptance(self, sample: bool, depth: int, chain: int) -> AcceptanceModel:
        key = (sample, depth, chain)
        if key not in self._acceptance:
            self._acceptance[key] = AcceptanceModel(depth, chain)
        return self._acceptance[key]

    def stored(self, key: str) -> CostModel:
        """The costs kept for `key`: loaded from the user cache at first, then learnt in this process."""
        if key not in self._costs:
            self._costs[key] = load_costs(key, self.cache_dir) or CostModel()
        return self._costs[key]

    def rebase(self, key: str, basis: str, keep: bool = False) -> None:
        """Costs under `key` are timed under `basis`, the backend's word for how it computes (the kernel's linear
        forms): curves timed under another no longer hold and are dropped, unless `keep` (a backend still learning,
        which only moves to faster ways: the steps that time them bring them down; dropping them would time every
        width again)."""
        if self.fixed is not None:
            return
        costs = self.stored(key)
        if costs.basis != basis:
            if not keep:
                costs.ms, costs.timed_at = {}, {}
            costs.basis = basis

    def costs(self, key: str, rows: int, limit: int, measure: Callable[[int], float], calibrate: bool | None
              ) -> CostModel | None:
        """The cost model for `key` for `rows` rows up to width `limit`, or None where it has none.

        calibrate None: what is not known yet (`CostModel.untimed`) is learnt from the call's first
        steps, each verifying one such width (no forward is spent on timing alone, so a first call
        costs little more than later ones); True: time every width again now, with `measure(width) ->
        ms`, one verify forward as the backend computes it; False: never
        (without stored costs, None).
        """
        if self.fixed is not None:
            if not self.fixed.ms:
                raise ValueError("the cost model given as budget holds no costs: build it with CostModel.from_function")
            return self.fixed
        costs = self.stored(key)
        if calibrate is None:
            return costs
        if calibrate:
            costs.calibrate(rows, limit, measure)
            save_costs(key, costs, self.cache_dir)
        return costs if costs.covers(rows, 1) else None

    def save(self, key: str) -> None:
        """Keep what the timed steps refined for the next process."""
        if self.fixed is None and key in self._costs:
            save_costs(key, self._costs[key], self.cache_dir)
