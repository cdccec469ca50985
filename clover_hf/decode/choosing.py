"""The draft budget inside one generate call: this machine's verify costs (learnt from the first steps
where unknown), each step's cut of every row's draft to the nodes that pay, and what the budget learns
from the step."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch
from transformers import PreTrainedModel

from clover_hf.backends import TorchBackend
from clover_hf.base.cache import compact_cache
from clover_hf.core.hardware import timed
from clover_hf.heads.tree import DynamicTree, TreeBuffers

from .acceptance import AcceptanceModel, path_chances
from .budget import DraftBudget
from .costs import CostModel
from .drafting import Draft, shallower
from .rows import Batch
from .widths import choose_width, laggard_tokens, likeliest

EXPLORE_LIMIT = 3.0  # the first steps stop learning wider widths once one costs this many one-token steps
LEARN_STEPS = 32  # steps a call verifies a width the form trials have still to learn, at most (`StepBudget.learn`)


class StepBudget:
    """A `DraftBudget` at work in one generate call, with the costs it has for this machine and batch."""

    def __init__(self, budget: DraftBudget, key: str, costs: CostModel, acceptance: AcceptanceModel, depth: int,
                 lookup_max: int, explore: list[int] | None = None, rows: int = 1, setting: Hashable | None = None,
                 forms_settled: bool = True) -> None:
        self.budget, self.key, self.costs, self.acceptance = budget, key, costs, acceptance
        self.gate = budget.gate_for(rows, setting)  # the call's: its batch's rows, as it began, and its tree
        self.rows = rows
        self.forms_settled = forms_settled  # whether the linear forms have settled and their weight copies are made
        if forms_settled and self.gate.unsettled:
            self.gate.restart()
        self.depth, self.lookup_max = depth, lookup_max
        self.buckets: list[list[int]] = []  # each row's acceptance bucket per node of this step's cut draft
        self.explore = list(explore or [])  # widths whose cost the next steps learn, one a step, narrowest first
        self.exploring = False  # whether this step verifies a width to learn its cost
        self.cap: int | None = None  # verify at most this many tokens per row this step (set by the backend)
        self.learning_steps = 0  # steps this call verified a width for the form trials to learn (`learn`)
        if forms_settled and budget.fixed is None:  # timed by an earlier call (or process) while the forms were learnt
            self._time_again(set(self.provisional))

    @property
    def provisional(self) -> set[tuple[int, int]]:
        """(rows, width) timed while the forms were being learnt, not timed again since (kept with the costs)."""
        return self.costs.provisional

    @classmethod
    def start(cls, budget: DraftBudget | None, key: str | None, calibrate: bool | None, model: PreTrainedModel,
              batch: Batch, widest: int, depth: int, lookup_max: int, sample: bool, verify: TorchBackend,
              setting: Hashable | None = None, forms_settled: bool = True) -> StepBudget | None:
        """The budget for this call with its verify costs: those not known yet are learnt from the first
        steps, or timed now (`calibrate`: see `DraftBudget.costs`); None without a budget or costs, or
        for a budget that does not cut (`DraftBudget.whole_tree`): the whole tree is verified every step.
        Where `verify` pads trees to width buckets (compiled), only those are timed. `setting`: the caller's
        tree and chain, where they override the heads' own (the heads gate is kept per setting);
        `forms_settled`: whether the linear forms have settled and their weight copies are made (else the call's
        steps cost more than they will, and the heads gate judges afresh once they have: `forms_ready`)."""
        if budget is None or not budget.cut or not batch.active:
            return None
        widest = min(widest, budget.widest or widest)
        rows = len(batch.active)
        if budget.fixed is None and key is not None:
            budget.stored(key).buckets = verify.buckets
        costs = budget.costs(key, rows, widest, measure_verify(model, batch, batch.active[0].root, verify), calibrate)
        if costs is None:
            return None
        acceptance = budget.acceptance(sample, depth, lookup_max)
        explore = [] if budget.fixed is not None else costs.untimed(rows, widest)
        return cls(budget, key, costs, acceptance, depth, lookup_max, explore, rows, setting, forms_settled)

    def learn(self, width: int | None) -> None:
        """Verify `width` tokens a row this step (None: choose by cost), at most LEARN_STEPS steps a call: the form
        trials' next row count to learn (`FormTrials.width_to_learn`). Widths timed while their forms were still
        being learnt look dear, and the choice by cost would not verify them again: their row count would stay
        pending for good, and every later call would run its steps in forms still being timed."""
        if width is None or self.learning_steps >= LEARN_STEPS or (self.cap is not None and width > self.cap):
            return
        if not self.explore or self.explore[0] != width:
            self.explore.insert(0, width)
        self.learning_steps += 1

    def drafting(self) -> bool:
        """Whether the heads draft this step (else the lookup chain alone is verified; never when one token
        is; always while learning the costs of wider steps, which need their drafts, but for heads that can never
        pay (`HeadsGate.hopeless`): the lookup chain alone then gives what wider steps are timed with)."""
        wider = any(w > 1 for w in self.explore) and not self.gate.hopeless
        return self.budget.widest != 1 and self.cap != 1 and (wider or self.gate.drafting())

    def shallower(self, spec: list[list[int]] | DynamicTree, trees: list[TreeBuffers] | None):
        """The tree spec and static trees cut to the depth the heads' drafts have been used to lately."""
        return shallower(spec, trees, self.gate.draft_depth(self.depth), self.lookup_max)

    def choose(self, drafts: list[Draft], with_heads: bool, started: float, augment_s: float, augmented: int,
               lengths: list[int]) -> list[Draft]:
        """Each row's draft cut to the nodes that pay. `started`: when drafting began (perf_counter), of
        which `augment_s` went to the Augmenting Block's catching up on `augmented` positions; `lengths`:
        each row's text length so far (a batch's rows ahead of its last one gain the call nothing)."""
        draft_ms = None  # (drafting, Augmenting Block per position) in ms, when the heads drafted
        if with_heads and self.costs.draft_ms is not None:
            draft_ms = (self.costs.draft_ms, 0.0)
        elif with_heads:
            for draft in drafts:  # read now, not in the choice: off the CPU drafting runs until read
                draft.on_host()
            drafting_s = time.perf_counter() - started - augment_s
            draft_ms = (1000 * drafting_s, 1000 * augment_s / max(augmented, 1))
            self._judge_cost(drafts, draft_ms[0])
        self.exploring = bool(self.explore) and (self.cap is None or self.explore[0] <= self.cap)
        width = self.explore[0] if self.exploring else None  # taken off once its step is timed
        most = self.budget.widest if self.cap is None else min(self.budget.widest or self.cap, self.cap)
        leads = [length - min(lengths) for length in lengths]
        drafts, self.buckets, forced = choose_nodes(
            drafts, self.acceptance, self.costs, self.gate, draft_ms, explore=self.budget.fixed is None,
            most=most, width=width, leads=leads, least=self._least_to_explore(len(lengths), width))
        if with_heads and not self.forms_settled:
            self.gate.unsettled = True
        if self.exploring and not forced:  # not worth timing in this call: left to the choice and to later calls
            self.explore.pop(0)
            self.exploring = False
        return drafts

    def _judge_cost(self, drafts: list[Draft], draft_ms: float) -> None:
        """One row's drafting step against the most it could save (`HeadsGate.beyond_gain`): its deepest drafted
        level, each accepted level a one-token step saved."""
        one_token = self.costs.ms.get(1, {}).get(1)
        if len(drafts) != 1 or one_token is None:
            return
        depths, _, _, is_chain = drafts[0].on_host()
        self.gate.beyond_gain(draft_ms, max((d for d, c in zip(depths, is_chain) if not c), default=0), one_token)

    def _least_to_explore(self, rows: int, width: int | None) -> float | None:
        """The expected tokens a batch's step must hold to be worth verifying `width` tokens a row to learn its
        cost: as many as would pay if it cost what one row of as many tokens does (the cheapest it plausibly
        costs). None (explore whatever the drafts): one row, or no one-row costs yet. Without it, a batch of
        many rows spends whole wide steps learning costs for drafts that bring no token."""
        one_row = self.costs.ms.get(1, {})
        if rows == 1 or width is None or 1 not in one_row:
            return None
        return self.costs.predict(1, rows * width) / self.costs.predict(1, rows)

    def accepted(self, row: int, draft: Draft, nodes: torch.Tensor) -> None:
        """Learn which of the row's verified nodes were accepted."""
        self.acceptance.observe(self.buckets[row], draft.host[1], nodes.tolist())

    def verified(self, rows: int, width: int, started: float, settled: bool = True, provisional: bool = False
                 ) -> None:
        """Refine the costs with this step's time since `started` (before the verify forward) for `rows` x `width`
        tokens; a step that was not `settled` (its forward compiled) teaches nothing, and what it explored
        is explored again. A `provisional` step (its forward still learning the linear forms, or making or
        missing weight copies they compute from) times only a width with no cost from settled steps, as it
        ran; a settled step of such a width replaces its cost, and once a step of as many tokens or more runs in
        settled forms, the narrower ones are timed again (`_time_again`)."""
        if not settled:
            return
        if self.exploring and self.explore:
            self.explore.pop(0)
        if self.budget.fixed is None:
            ms = 1000 * (time.perf_counter() - started)
            timed = self.costs.ms.get(rows, {})
            if provisional and width in timed and (rows, width) not in self.provisional:
                return  # a cost timed in settled forms is not made dearer by a step still learning them
            if self.exploring and width not in timed:
                self.costs.record(rows, width, ms)
                one = self.costs.ms[rows].get(1)
                # wider ones cost more still: no use timing them (unless this one's forms were still being learnt)
                if one is not None and ms > EXPLORE_LIMIT * one and not provisional:
                    self.explore.clear()
            else:
                if not provisional and (rows, width) in self.provisional:  # timed settled at last: replaced
                    self.costs.doubt([(rows, width)])
                    self.provisional.discard((rows, width))
                self.costs.observe(rows, width, ms)
            if provisional:
                self.provisional.add((rows, width))
            elif self.provisional:  # this step's products ran settled, and so do those of fewer rows
                self._time_again({(r, w) for r, w in self.provisional if r * w <= rows * width})

    def forms_ready(self) -> None:
        """The linear forms have settled and their weight copies are made: time again every width timed before,
        and judge the heads afresh."""
        self._time_again(set(self.provisional))
        self.forms_settled = True
        if self.gate.unsettled:
            self.gate.restart()

    def _time_again(self, timed: set[tuple[int, int]]) -> None:
        """Forget the costs of these provisionally timed (rows, width), to be explored again (a step that made
        weight copies took several times its cost: doubting it would still rule it out); one token's, which every
        choice needs, is doubted instead (`CostModel.doubt`: its next timing replaces it) and explored first (where
        the heads pay, one-token steps are rare: left at its provisional cost, it made the lookup chain alone look
        dear to the heads gate). Those of other row counts than the call's are left to a call of theirs."""
        timed = {(r, w) for r, w in timed if r == self.rows}
        for rows, width in timed:
            curve = self.costs.ms.get(rows, {})
            if width == 1 or width not in curve:
                self.costs.doubt([(rows, width)])
                if width == 1 and 1 not in self.explore:
                    self.explore.insert(0, 1)
                continue
            del curve[width]
            if width not in self.explore:  # (trials run at batch 1: the rows the explored widths are timed at)
                self.explore = sorted([*self.explore, width])
        self.provisional.difference_update(timed)

    def save(self) -> None:
        self.budget.save(self.key)


def choose_nodes(drafts: list[Draft], acceptance: AcceptanceModel, costs: CostModel, gate,
                 draft_ms: tuple[float, float] | None, explore: bool, most: int | None = None,
                 width: int | None = None, leads: list[int] | None = None, least: float | None = None
                 ) -> tuple[list[Draft], list[list[int]], bool]:
    """Cut each row's draft to the nodes that pay: the width with the most expected tokens per
    millisecond under `costs` (`explore`: retrying widths untimed for long), each row keeping its
    likeliest nodes. When the heads drafted (`draft_ms`: their drafting time, and the Augmenting Block's
    per position), tells `gate` how that compared with the chain alone. `most`: verify at most this many
    tokens per row; `width`: this many (or the whole draft), whatever the costs say (to learn that width's
    cost; the gate then learns nothing), unless the step's expected tokens at that width fall short of
    `least`; `leads`: tokens each row of a batch is ahead of its last one. Returns the cut drafts, each
    node's acceptance bucket, and whether `width` was verified."""
    buckets, chances, node_depths = [], [], []
    for d in drafts:
        depths, parents, probs, is_chain = d.on_host()
        b = acceptance.buckets(depths, probs, is_chain, d.ngram)
        buckets.append(b)
        chances.append(path_chances(acceptance.rates(b), parents)[1:])
        node_depths.append(depths[1:])
    by_last_row = {"depths": node_depths, "leads": leads}
    forced = width is not None
    if forced:
        width = min(width, most or width, 1 + max(len(c) for c in chances))
        if least is not None:
            forced = laggard_tokens(chances, node_depths, leads, [width])[width] >= least
    if not forced:
        overhead, without = 0.0, 0.0  # drafting's cost, and the rate of the lookup chain alone
        if draft_ms is not None:
            overhead, without = gate.drafting_ms(*draft_ms), chain_rate(chances, drafts, costs, by_last_row)
        width, tokens, ms = choose_width(chances, costs, explore, most, overhead, without, **by_last_row)
    cut, cut_buckets = [], []
    for d, b, c in zip(drafts, buckets, chances):
        if width >= len(b):
            cut.append(d)
            cut_buckets.append(b)
        elif width == 1:
            cut.append(d.root_only())
            cut_buckets.append(b[:1])
        else:
            nodes = likeliest(c, width)
            cut.append(d.keep(nodes))
            cut_buckets.append([b[i] for i in nodes])
    if draft_ms is not None and not forced:
        gate.record(*draft_ms, tokens, ms, without)
        gate.used(max(depth for d in cut for depth, chain in zip(d.host[0], d.host[3]) if not chain))
    return cut, cut_buckets, forced


def chain_rate(chances: list[list[float]], drafts: list[Draft], costs: CostModel, by_last_row: dict | None = None
               ) -> float:
    """Expected tokens per ms of the step with the lookup chain's nodes alone (what it gets without the heads);
    `by_last_row`: a batch's node depths and leads, as `choose_width` takes them."""
    chain_only = [[x if chain else 0.0 for x, chain in zip(c, d.host[3][1:])] for c, d in zip(chances, drafts)]
    _, tokens, ms = choose_width(chain_only, costs, **(by_last_row or {}))
    return tokens / ms


def measure_verify(model: PreTrainedModel, batch: Batch, token: torch.Tensor, verify: TorchBackend
                   ) -> Callable[[int], float]:
    """`measure(width) -> ms`: the time of one `verify` forward of `width` tokens per row over the batch's
    cache as it is, which is then cut back. Calibrates the draft budget's cost model."""
    rows, past_len = batch.positions.shape
    device = batch.positions.device
    last = batch.positions.max(dim=1, keepdim=True).values  # a position every model embeds: one it already has

    def measure(width: int) -> float:
        width = verify.width(width, batch.room())
        new_pos = last.expand(rows, width)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(rows, -1, -1)
        mask = batch.attention(new_pos, causal, model.dtype)
        _, seconds = timed(lambda: verify.verify(token.expand(rows, width), mask, new_pos, batch.cache), device)
        compact_cache(batch.cache, past_len, new_pos[:, :0])
        return 1000 * seconds

    return measure
