"""The draft budget: cost model, calibrated acceptance, the per-step choice, and exactness under it.

Costs are injected (`CostModel.from_function`), never read off the clock, so every assertion here is
about what the chooser does with given costs.
"""

from __future__ import annotations

import json

import pytest
import torch

from clover_hf import CloverForCausalLM, CostModel, DraftBudget
from clover_hf.backends import FormBook
from clover_hf.backends.kernel_forms import MachineForms, basis
from clover_hf.backends.keys import machine_key
from clover_hf.core.hardware import native_bf16_cpu
from clover_hf.cpu.dtype import default_dtype
from clover_hf.decode.acceptance import HEAD_BINS, AcceptanceModel, path_chances
from clover_hf.decode.budget import CATCH_UP_STEPS, MIN_PAUSE, PAUSE_MARGIN, PROBE_STEPS, HeadsGate
from clover_hf.decode.costs import COSTS_FILE, load_costs, save_costs
from clover_hf.decode.widths import choose_width, laggard_tokens, likeliest, prune

from .tiny import ARCHS, left_padded, patch_kernel, prompt, same, tiny_model

FLAT = CostModel.from_function(lambda rows, width: 10.0, draft_ms=0.0)  # verifying more costs nothing
STEEP = CostModel.from_function(lambda rows, width: 10.0 * rows * width, draft_ms=5.0)  # each token costs a forward


def test_cost_model_interpolates_and_refines():
    costs = CostModel({1: {1: 10.0, 4: 16.0, 8: 40.0}})
    assert costs.predict(1, 4) == 16.0
    assert costs.predict(1, 2) == pytest.approx(12.0)  # linear between 1 and 4
    assert costs.predict(1, 16) == pytest.approx(80.0)  # past the widest: proportional
    assert costs.predict(3, 4) == 16.0  # an unseen row count starts from the nearest one's costs
    assert costs.widths(1, 6) == [1, 4, 6]  # measured widths below the limit, and the limit
    costs.observe(1, 4, 26.0)
    assert costs.predict(1, 4) == pytest.approx(16.0 + costs.smoothing * 10.0)
    costs.observe(1, 2, 20.0)  # a new width starts at its interpolated cost, between widths 1 and 4
    start = 10.0 + (costs.predict(1, 4) - 10.0) / 3
    assert costs.predict(1, 2) == pytest.approx(start + costs.smoothing * (20.0 - start))
    before = costs.predict(1, 8)
    costs.observe(1, 8, 10_000.0)  # a stall counts as twice the estimate, no more
    assert costs.predict(1, 8) == pytest.approx(before + costs.smoothing * before)
    restored = CostModel.from_json(json.loads(json.dumps(costs.to_json())))
    assert restored.ms.keys() == costs.ms.keys()
    for rows, curve in costs.ms.items():
        assert restored.ms[rows] == pytest.approx(curve, abs=1e-3)  # stored to the microsecond


def test_costs_are_kept_per_key(tmp_path):
    assert load_costs("machine A", tmp_path) is None
    save_costs("machine A", CostModel({1: {1: 5.0, 2: 6.0}}), tmp_path)
    save_costs("machine B", CostModel({1: {1: 9.0}}), tmp_path)
    assert load_costs("machine A", tmp_path).ms == {1: {1: 5.0, 2: 6.0}}
    assert load_costs("machine B", tmp_path).ms == {1: {1: 9.0}}
    (tmp_path / COSTS_FILE).write_text("{not json")
    assert load_costs("machine A", tmp_path) is None  # a damaged file is measured again, not fatal


def test_budget_learns_unknown_costs_from_steps_and_times_them_only_when_asked(tmp_path):
    calls, planned = [], []

    def measure(width: int) -> float:
        calls.append(width)
        return 10.0 + width + (5.0 if calls.count(width) == 1 else 0.0)  # the first forward of a width is slow

    def forms(copy_limit: int) -> dict[int, str]:
        planned.append(True)
        return {2: "transposed"}

    budget = DraftBudget(cache_dir=tmp_path)
    assert FormBook.of(budget).forms("m", None, forms) == {2: "transposed"} and len(planned) == 1
    costs = budget.costs("m", rows=1, limit=11, measure=measure, calibrate=None)
    assert calls == [] and costs.untimed(1, 11) == [1, 2, 3, 4, 6, 8, 11]  # nothing timed: the steps will learn them
    for width in (1, 2, 3):  # three steps of a call learn three widths
        costs.record(1, width, 10.0 + width)
    assert costs.untimed(1, 11) == [4, 6, 8, 11] and costs.untimed(2, 11)[0] == 1  # per batch size
    budget.save("m")
    fresh = DraftBudget(cache_dir=tmp_path)  # a new process reads the cache
    assert FormBook.of(fresh).forms("m", None, forms) == {2: "transposed"} and len(planned) == 1
    again = fresh.costs("m", 1, 11, measure, None)
    assert calls == [] and again.ms == {1: {1: 11.0, 2: 12.0, 3: 13.0}} and again.untimed(1, 11) == [4, 6, 8, 11]
    forced = DraftBudget(cache_dir=tmp_path)
    FormBook.of(forced).forms("m", True, forms)
    timed = forced.costs("m", 1, 11, measure, calibrate=True)
    assert calls[0] == 1 and sorted(set(calls)) == [1, 2, 3, 4, 6, 8, 11]  # warm-up, then each calibrated width
    assert len(calls) == 1 + 7 + 4 and len(planned) == 2  # forced: forms and every width, up to 4 twice
    assert timed.predict(1, 11) == 26.0 and timed.predict(1, 4) == 14.0  # narrow widths: the faster of two
    calls.clear()
    skipped = DraftBudget(cache_dir=tmp_path)
    assert FormBook.of(skipped).forms("other", False, forms) == {} and skipped.costs("other", 1, 11, measure, False) is None
    assert calls == [] and len(planned) == 2  # skipped: nothing measured, and without stored costs no budget


def test_costs_stored_before_linear_forms_were_chosen_are_learnt_again(tmp_path):
    save_costs("m", CostModel({1: {1: 50.0, 4: 90.0, 8: 95.0}}), tmp_path)
    assert load_costs("m", tmp_path).basis is None
    budget = DraftBudget(cache_dir=tmp_path)
    book = FormBook.of(budget)
    assert book.forms("m", None, lambda _: {4: "float32"}) == {4: "float32"}
    budget.rebase("m", basis({4: "float32"}))
    costs = budget.costs("m", 1, 8, lambda w: pytest.fail("timed up front"), None)
    assert costs.ms == {} and costs.untimed(1, 8) == [1, 2, 3, 4, 6, 8]
    assert FormBook(cache_dir=tmp_path).stored("m").forms == {4: "float32"}  # kept for the next process


def test_forms_that_change_on_recalibration_drop_curves_timed_under_the_old_ones(tmp_path):
    budget = DraftBudget(cache_dir=tmp_path)
    book = FormBook.of(budget)
    measure = lambda width: 10.0 + width  # noqa: E731

    def forms(calibrate, measured, keep=False):
        chosen = book.forms("m", calibrate, lambda _: measured)
        budget.rebase("m", basis(chosen), keep)
        return chosen

    forms(None, {4: "transposed"})
    budget.costs("m", 2, 4, measure, True)
    assert forms(None, {2: "transposed"}) == {4: "transposed"}  # stored forms kept
    assert set(budget.costs("m", 1, 4, measure, True).ms) == {1, 2}
    assert forms(True, {4: "transposed"}) == {4: "transposed"}  # the same again: curves kept
    assert set(budget.costs("m", 1, 4, measure, None).ms) == {1, 2}
    forms(True, {8: "float32"}, keep=True)  # forms still being learnt: curves kept
    assert set(budget.costs("m", 1, 4, measure, None).ms) == {1, 2}
    forms(True, {8: "transposed"})
    assert set(budget.costs("m", 1, 4, measure, True).ms) == {1}


def test_acceptance_learns_per_bucket():
    model = AcceptanceModel(depth=2, chain=4)
    depths, parents = [0, 1, 1, 2, 1, 2], [0, 0, 0, 1, 0, 4]
    probs = [1.0, 0.95, 0.05, 0.5, 1.0, 1.0]
    is_chain = [False, False, False, False, True, True]
    buckets = model.buckets(depths, probs, is_chain, ngram=3)
    chain_start = 2 * HEAD_BINS + 2 * 4  # after the heads' bins and the 1- and 2-gram chains
    assert buckets == [-1, HEAD_BINS - 1, 0, HEAD_BINS + 5, chain_start, chain_start + 1]
    before = model.rates(buckets)
    assert before[0] == 1.0 and before[1] == pytest.approx(0.95) and before[2] == pytest.approx(0.05)
    for _ in range(50):  # the confident depth-1 head node is never right; the chain always is
        model.observe(buckets, parents, accepted=[0, 4, 5])
    after = model.rates(buckets)
    assert after[1] < 0.05 and after[4] > 0.95 and after[5] > 0.95
    assert after[3] == pytest.approx(before[3])  # never tried: its parent (node 1) was never accepted
    untried = model.rates(model.buckets([2], [0.95], [False], 0))
    assert untried == [pytest.approx(0.95)]  # another bucket keeps its prior


def test_path_chances_multiply_along_paths():
    chances = path_chances([1.0, 0.5, 0.4, 0.5, 0.9], parents=[0, 0, 0, 1, 3])
    assert chances == pytest.approx([1.0, 0.5, 0.4, 0.25, 0.225])


def test_choose_width_follows_the_costs():
    chances = [[0.9, 0.6, 0.3, 0.1]]  # expected tokens 1, 1.9, 2.5, 2.8, 2.9
    assert choose_width(chances, FLAT)[0] == 5  # the whole tree
    assert choose_width(chances, STEEP)[0] == 1  # a plain decoding step
    # 10 ms + 6 ms per extra token: rates 0.1, 0.119, 0.114, ... -> 2 tokens
    width, tokens, ms = choose_width(chances, CostModel.from_function(lambda r, w: 10.0 + 6.0 * (w - 1)))
    assert (width, tokens, ms) == (2, pytest.approx(1.9), 16.0)
    # two rows share the width: their expected tokens add up
    rows = [chances[0], [0.99, 0.98, 0.97, 0.96]]
    assert choose_width(rows, CostModel.from_function(lambda r, w: 10.0 + 2.0 * (w - 1)))[0] == 5


def test_a_batch_counts_the_tokens_that_move_its_last_row():
    """A call ends with its last row: tokens that take a row further ahead of it do not shorten the call."""
    # two level rows, each with one drafted token at depth 1: both must accept it to move the last row by two
    assert laggard_tokens([[0.5], [0.5]], [[1], [1]], [0, 0], [1, 2]) == {1: 1.0, 2: pytest.approx(1.25)}
    # row 0 one token ahead: the step moves the last row (row 1) past row 0's start only if row 0 accepts too
    chains = [[0.9, 0.8], [0.5, 0.4]]  # each row's chain: depths 1 and 2
    depths = [[1, 2], [1, 2]]
    assert laggard_tokens(chains, depths, [1, 0], [3])[3] == pytest.approx(1 + 0.5 + 0.4 * 0.9)
    # a row as far ahead as the tree is deep never holds the last row back: its tokens count alone
    assert laggard_tokens(chains, depths, [2, 0], [2, 3]) == {2: pytest.approx(1.5), 3: pytest.approx(1.9)}
    # siblings exclude each other: the chances of a depth's kept nodes add up, in the order `likeliest` keeps them
    assert laggard_tokens([[0.3, 0.6, 0.2], [0.3, 0.6, 0.2]], [[1, 1, 2], [1, 1, 2]], [0, 0], [2, 3, 4]) == {
        2: pytest.approx(1 + 0.36), 3: pytest.approx(1 + 0.81), 4: pytest.approx(1 + 0.81 + 0.04)}
    # in choose_width: a likely token in one row and an unlikely one in the other pay by the rows' sum, not
    # by the last row; once the unlikely row is ahead, the likely one is the last and its token pays
    costs = CostModel.from_function(lambda rows, w: 10.0 + 3.0 * (w - 1), max_width=2)
    split, level = [[0.9], [0.1]], {"depths": [[1], [1]]}
    assert choose_width(split, costs)[0] == 2  # 3.0 tokens in 13 ms against 2 in 10
    assert choose_width(split, costs, leads=[0, 0], **level)[:2] == (1, 1.0)  # 1.09 in 13 ms against 1 in 10
    assert choose_width(split, costs, leads=[0, 1], **level)[:2] == (2, pytest.approx(1.9))


def test_a_width_that_adds_no_expected_token_is_never_chosen_however_stale():
    """Stale widths are priced lower so that a wrong estimate is retried; one whose drafts add nothing to a narrower
    width's expected tokens could never pay, and is not retried on such a step (a batch of 4 on the AVX-512-bf16
    EPYC verified 2-5 tokens a row on steps that expected no drafted token to hold)."""
    costs = CostModel({1: {1: 10.0, 2: 12.0, 4: 14.0}})
    costs.timed_ms = 1e9  # wider widths went untimed for long: priced at a quarter of their estimates
    costs.timed_at = {1: {1: 1e9}}  # one token was timed last step
    assert costs.price(1, 4) < costs.price(1, 1) == 10.0
    assert choose_width([[0.0, 0.0, 0.0]], costs, explore=True)[:2] == (1, 1.0)
    assert choose_width([[0.3, 0.0, 0.0]], costs, explore=True)[:2] == (2, pytest.approx(1.3))


def _run_budget(costs: CostModel, true_ms, chances: list[list[float]], steps: int, explore: bool
                ) -> tuple[list[int], float]:
    """Choose and time `steps` steps against the costs `true_ms(width)`; the widths chosen and the
    expected tokens per true millisecond over all steps."""
    chosen, tokens, ms = [], 0.0, 0.0
    for _ in range(steps):
        width, expected, _ = choose_width(chances, costs, explore)
        costs.observe(1, width, true_ms(width))
        chosen.append(width)
        tokens, ms = tokens + expected, ms + true_ms(width)
    return chosen, tokens / ms


CHANCES = [[0.8, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05]]  # whole tree: 3.5 tokens


def test_a_width_that_looks_too_dear_is_tried_again_and_corrected():
    """Stored costs from a slower period put wide widths at 2.5x what they cost now. Only chosen
    widths are timed, so without retrying them the budget verifies one token a step for good."""
    def true_ms(width: int) -> float:
        return 55.0 if width == 1 else 85.0 + 1.5 * width  # the whole tree (8 tokens) pays most: 3.5 / 97 ms

    def stale() -> CostModel:
        return CostModel({1: {w: 64.0 if w == 1 else 2.5 * true_ms(w) for w in (1, 2, 4, 8, 16)}})

    stuck, _ = _run_budget(stale(), true_ms, CHANCES, 2000, explore=False)
    assert set(stuck) == {1}
    costs = stale()
    chosen, _ = _run_budget(costs, true_ms, CHANCES, 1000, explore=True)
    assert 8 in chosen
    assert costs.predict(1, 8) == pytest.approx(true_ms(8), rel=0.02)
    chosen, rate = _run_budget(costs, true_ms, CHANCES, 1000, explore=True)
    assert chosen.count(8) > 0.99 * len(chosen)
    assert rate > 0.99 * 3.5 / true_ms(8)


def test_retrying_dear_widths_costs_little():
    """Where wide widths really are dear (each token costs most of a forward), retrying them now and
    then loses under 1% of the best expected rate."""
    def true_ms(width: int) -> float:
        return 55.0 * width ** 0.9

    costs = CostModel.from_function(lambda rows, width: true_ms(width), rows=(1,), max_width=16)
    chosen, rate = _run_budget(costs, true_ms, CHANCES, 5000, explore=True)
    assert chosen.count(1) > 0.95 * len(chosen)  # mostly width 2, within 4% of the best rate
    assert rate > 0.99 / true_ms(1)


def test_a_fixed_cost_model_is_never_retimed_or_doubted():
    """Retrying stale widths is for measured costs: a fixed `CostModel` makes the same choices on every run."""
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, lookup_tokens=2, lookup_max_tokens=4)
    costs = CostModel.from_function(lambda rows, width: 10.0 + 3.0 * width, draft_ms=1.0)
    before = json.dumps(costs.to_json())
    runs = []
    for _ in range(2):
        clover.generate(prompt(3), max_new_tokens=40, do_sample=False, budget=costs)
        stats = clover.generation_stats
        runs.append((stats.verified_tokens, list(stats.accepted_lengths)))
    assert runs[0] == runs[1]
    assert json.dumps(costs.to_json()) == before and costs.timed_ms == 0.0


def test_likeliest_nodes_form_a_tree():
    parents, depths = [0, 0, 0, 1, 1, 3], [0, 1, 1, 2, 2, 3]
    chances = path_chances([1.0, 0.9, 0.3, 0.8, 0.05, 0.9], parents)[1:]
    keep = likeliest(chances, 4)
    assert keep == [0, 1, 3, 5]  # 0.9, 0.72, 0.648 beat 0.3: a chain through node 1
    assert prune(parents, depths, keep) == ([0, 0, 1, 2], [0, 1, 2, 3])


def test_heads_gate_pauses_long_enough_that_judging_the_heads_again_costs_a_tenth_of_the_pause():
    """Drafting that costs most of a verify step (a batch's rows draft one by one) is judged again only after
    PROBE_STEPS * its cost / PROBE_SHARE of paused steps, not after MIN_PAUSE."""
    from clover_hf.decode.budget import MAX_PAUSE, PROBE_SHARE

    gate = HeadsGate()
    for _ in range(PROBE_STEPS):
        gate.record(draft_ms=8.0, augment_ms=1.0, tokens=1.0, verify_ms=20.0, rate_without=0.05)
    assert gate.pause == round(PROBE_STEPS * 9.0 / (PROBE_SHARE * 20.0)) == 18 and gate.next_pause == 36
    cheap = HeadsGate()
    for _ in range(PROBE_STEPS):
        cheap.record(draft_ms=1.0, augment_ms=0.0, tokens=1.0, verify_ms=20.0, rate_without=0.06)
    assert cheap.pause == MIN_PAUSE
    dear = HeadsGate()
    for _ in range(PROBE_STEPS):
        dear.record(draft_ms=90.0, augment_ms=0.0, tokens=1.0, verify_ms=1.0, rate_without=1.0)
    assert dear.pause == MAX_PAUSE


def test_heads_gate_pauses_while_drafting_does_not_pay():
    """Judged afresh (at first, and after each pause) over PROBE_STEPS drafting steps; then by its running gain."""
    gate = HeadsGate()
    assert gate.drafting()
    for _ in range(PROBE_STEPS):
        assert gate.pause == 0
        gate.record(draft_ms=0.1, augment_ms=0.0, tokens=1.5, verify_ms=10.0, rate_without=0.2)  # 1.5/10.1 < 0.2
    assert [gate.drafting() for _ in range(MIN_PAUSE + 1)] == [False] * MIN_PAUSE + [True]
    for _ in range(PROBE_STEPS):
        gate.record(draft_ms=0.1, augment_ms=0.0, tokens=1.5, verify_ms=10.0, rate_without=0.2)
    assert [gate.drafting() for _ in range(2 * MIN_PAUSE + 1)] == [False] * (2 * MIN_PAUSE) + [True]  # doubled
    for _ in range(PROBE_STEPS - 1):
        gate.record(draft_ms=0.0, augment_ms=0.0, tokens=3.0, verify_ms=10.0, rate_without=0.2)
    gate.record(draft_ms=0.0, augment_ms=0.0, tokens=3.0, verify_ms=10.0, rate_without=0.2)  # pays now
    assert gate.drafting() and gate.next_pause == 2 * MIN_PAUSE  # halved with each step that pays
    gate.record(draft_ms=0.0, augment_ms=0.0, tokens=3.0, verify_ms=10.0, rate_without=0.2)
    assert gate.drafting() and gate.next_pause == MIN_PAUSE


def test_heads_a_little_slower_than_the_chain_alone_by_estimate_keep_drafting():
    """Only a clear estimated loss pauses the heads (PAUSE_MARGIN): pausing costs what the estimate leaves out."""
    assert 0.05 < PAUSE_MARGIN < 0.2  # the two cases below lie on either side of it
    gate = HeadsGate()
    for _ in range(2 * PROBE_STEPS):
        gate.record(draft_ms=1.0, augment_ms=0.0, tokens=1.9, verify_ms=19.0, rate_without=0.1)  # 0.095: 5% slower
    assert gate.gain == pytest.approx(-0.05) and all(gate.drafting() for _ in range(10))
    for _ in range(PROBE_STEPS):
        gate.record(draft_ms=1.0, augment_ms=0.0, tokens=1.2, verify_ms=19.0, rate_without=0.1)  # 0.06: 40% slower
    assert not gate.drafting()


def test_one_step_whose_lookup_chain_alone_did_better_does_not_pause_the_heads():
    """Where the heads pay on average, a step whose chain alone would have done better (text copying earlier text)
    among the steps judged afresh does not pause them."""
    gate = HeadsGate()
    gate.record(draft_ms=1.0, augment_ms=0.0, tokens=1.2, verify_ms=18.0, rate_without=0.15)  # the chain did well
    for _ in range(PROBE_STEPS - 1):
        gate.record(draft_ms=1.0, augment_ms=0.0, tokens=2.2, verify_ms=20.0, rate_without=0.06)
    assert gate.gain is not None and gate.gain > 0 and all(gate.drafting() for _ in range(10))


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("costs", ["flat", "steep"])
def test_budget_keeps_greedy_exact(arch, costs):
    """Whatever the costs, greedy output equals the base's; a steep cost curve verifies one token per
    step (plain decoding) and stops drafting, a flat one verifies the whole tree."""
    base = tiny_model(arch)
    ids = prompt(3)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=0)
    out = clover.generate(ids, max_new_tokens=30, do_sample=False, budget=FLAT if costs == "flat" else STEEP)
    assert same(out, ref)
    stats = clover.generation_stats
    if costs == "steep":
        assert stats.verified_per_step == 1.0 and stats.new_tokens == stats.steps
        assert stats.head_drafts < (stats.steps - 1) / 2  # the gate paused drafting most of the time
    else:
        whole = len(clover.clover_config.tree) + 1
        cut = clover.clover_config.num_heads  # at most this many last steps, near max_length, verify shallower trees
        assert stats.verified_tokens >= whole * (len(stats.accepted_lengths) - cut)
        assert stats.head_drafts == stats.steps - 1


def test_after_a_long_pause_the_heads_catch_up_on_the_last_steps_only():
    """Where drafting did not pay for hundreds of steps, the Augmenting Block runs over the last
    `CATCH_UP_STEPS` steps' positions when the heads draft again, not over all of them; output stays exact."""
    base = tiny_model("llama")
    ids = prompt(3)
    ref = base.generate(ids, max_new_tokens=80, do_sample=False)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=0)
    budget = DraftBudget(costs=FLAT)
    budget.gate.pause = 60  # the heads sit out the first 60 steps
    ran = []
    features = clover.clover_heads.features
    clover.clover_heads.features = lambda hidden, *args, **kwargs: ran.append(hidden.shape[1]) or features(
        hidden, *args, **kwargs)
    assert same(clover.generate(ids, max_new_tokens=80, do_sample=False, budget=budget), ref)
    assert ran[0] == CATCH_UP_STEPS  # one position per plain step; the prompt and the first 28 steps are skipped
    assert clover.generation_stats.head_drafts == clover.generation_stats.steps - 1 - 60


def test_a_batch_s_heads_gate_is_its_own():
    """Whether drafting pays differs with the batch: the heads paused for a batch's calls still draft in one row's
    calls, and the other way round."""
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, lookup_tokens=0)
    budget = DraftBudget(costs=FLAT)
    budget.gate_for(2).pause = 1000
    ids = prompt(3)
    batch, mask, _ = left_padded(prompt(5, 7), prompt(6, 12))
    assert same(clover.generate(ids, max_new_tokens=20, do_sample=False, budget=budget),
                base.generate(ids, max_new_tokens=20, do_sample=False))
    assert clover.generation_stats.head_drafts == clover.generation_stats.steps - 1
    assert same(clover.generate(batch, attention_mask=mask, max_new_tokens=20, do_sample=False, budget=budget),
                base.generate(batch, attention_mask=mask, max_new_tokens=20, do_sample=False))
    assert clover.generation_stats.head_drafts == 0 and budget.gate is budget.gate_for(1) is not budget.gate_for(2)


def test_calls_with_another_tree_keep_a_heads_gate_of_their_own():
    """What drafting costs and gains depends on the tree: calls with the caller's own tree (or chain) neither
    inherit nor change the pauses of calls with the heads' tree."""
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, lookup_tokens=0)
    budget = DraftBudget(costs=FLAT)
    budget.gate.pause = 1000
    ids = prompt(3)
    ref = base.generate(ids, max_new_tokens=20, do_sample=False)
    for tree in ([[0], [1], [0, 0]], {"depth": 2, "width": 2, "nodes": 4}):
        assert same(clover.generate(ids, max_new_tokens=20, do_sample=False, budget=budget, tree=tree), ref)
        assert clover.generation_stats.head_drafts == clover.generation_stats.steps - 1
    assert same(clover.generate(ids, max_new_tokens=20, do_sample=False, budget=budget, lookup=2), ref)
    assert clover.generation_stats.head_drafts == clover.generation_stats.steps - 1
    assert same(clover.generate(ids, max_new_tokens=20, do_sample=False, budget=budget), ref)
    assert clover.generation_stats.head_drafts == 0 and budget.gate.pause == 1000 - 19
    assert len({id(gate) for gate in budget._gates.values()}) == 4


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_budget_exact_when_sampling_greedily_and_in_batches(tree):
    base = tiny_model("llama")
    spec = {"depth": 3, "width": 3, "nodes": 8} if tree == "dynamic" else None
    middle = CostModel.from_function(lambda rows, width: 10.0 + rows * width, draft_ms=1.0)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    ids = prompt(4)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    assert same(clover.generate(ids, max_new_tokens=30, do_sample=True, top_k=1, budget=middle, tree=spec), ref)
    batch, mask, _ = left_padded(prompt(5, 7), prompt(6, 12))
    ref = base.generate(batch, attention_mask=mask, max_new_tokens=20, do_sample=False)
    for costs in (middle, FLAT, STEEP):
        out = clover.generate(batch, attention_mask=mask, max_new_tokens=20, do_sample=False, budget=costs, tree=spec)
        assert same(out, ref)


def test_budget_follows_a_copying_text_with_long_chains():
    """Where the output repeats earlier text, the chain's record earns it long verifications."""
    base = tiny_model("llama")
    ids = prompt(2)
    ref = base.generate(ids, max_new_tokens=60, do_sample=False)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=2, lookup_max_tokens=16)
    cheap = CostModel.from_function(lambda rows, width: 10.0 + 0.1 * width, draft_ms=0.0)
    assert same(clover.generate(ids, max_new_tokens=60, do_sample=False, budget=cheap), ref)
    assert max(clover.generation_stats.accepted_lengths) > 8  # beyond the heads' depth: a long chain


def test_auto_budget_learns_its_costs_in_the_first_call_and_stays_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOVER_HF_CACHE", str(tmp_path))
    # the forms timed apart, as where batches or calibrate=True time them: the costs alone are learnt from the
    # steps (forms learnt from products make the first steps provisional: see test_form_trials)
    monkeypatch.setattr(FormBook, "form_trials", lambda self, *args: None)
    # a tiny model's steps take a millisecond or two: one hiccup (a CI run timed a 6-token step at 3x a one-token
    # one) would end the exploring early, by the rule test_first_steps_stop_learning_wider_widths... checks
    monkeypatch.setattr("clover_hf.decode.choosing.EXPLORE_LIMIT", float("inf"))
    base = tiny_model("qwen2")
    clover = CloverForCausalLM.from_base(base, lookup_tokens=2, lookup_max_tokens=4)
    ids = prompt(7)
    ref = base.generate(ids, max_new_tokens=20, do_sample=False)
    assert same(clover.generate(ids, max_new_tokens=20, do_sample=False), ref)
    stored = json.loads((tmp_path / COSTS_FILE).read_text())
    (key, curves), = stored.items()
    assert "float32" in key and torch.backends.cpu.get_cpu_capability() in key
    widths = {int(w) for w in curves["1"]}  # its first steps verified the calibrated widths, one each
    assert {1, 2, 3, 4, 6, 8, 12, 16, 24} <= widths and max(widths) <= len(clover.clover_config.tree) + 1 + 4
    assert clover.generation_stats.verified_per_step > 2  # the widths were verified by the steps themselves
    assert same(clover.generate(ids, max_new_tokens=20, do_sample=False, calibrate=False), ref)


def test_bad_budget_is_refused_before_any_forward():
    clover = CloverForCausalLM.from_base(tiny_model("llama"))
    with pytest.raises(ValueError, match="budget must be 'auto', 'full'"):
        clover.generate(prompt(1), max_new_tokens=4, budget="fast")
    with pytest.raises(ValueError, match="holds no costs"):
        clover.generate(prompt(1), max_new_tokens=4, budget=CostModel())


def test_default_dtype_follows_the_cpu(monkeypatch):
    import clover_hf.core.hardware as hardware
    import clover_hf.cpu.kernel as bf16_kernel

    monkeypatch.setattr(hardware, "cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(hardware, "bf16_reads_faster_cpu", lambda: False)
    patch_kernel(monkeypatch, "available", lambda: True)  # the compiled kernel reads bf16 alone
    assert not native_bf16_cpu() and default_dtype("cpu") == torch.bfloat16
    patch_kernel(monkeypatch, "available", lambda: False)  # no compiler, or CLOVER_HF_KERNEL=0
    assert default_dtype("cpu") == torch.float32
    monkeypatch.setattr(hardware, "bf16_reads_faster_cpu", lambda: True)  # no native bf16, but measured faster
    assert default_dtype("cpu") == torch.bfloat16
    monkeypatch.setattr(hardware, "bf16_reads_faster_cpu", lambda: False)
    monkeypatch.setattr(hardware, "cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert default_dtype("cpu") == torch.bfloat16
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # an AVX2-only CPU emulated
    assert default_dtype("cpu") == torch.float32
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset({"avx512f"}))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert default_dtype("cpu") == torch.float32  # AVX-512 without bf16
    assert default_dtype("cuda") == torch.bfloat16


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_one_token_steps_verify_one_token_in_the_forms_auto_uses(arch, tmp_path):
    """budget="one-token": Clover's kernels with plain decoding steps (no drafting), sharing the costs, forms
    and weight copies "auto" learned; the output is plain `generate`'s."""
    base = tiny_model(arch)
    ids = prompt(3)
    ref = base.generate(ids, max_new_tokens=24, do_sample=False)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    clover._draft_budget = DraftBudget(costs=FLAT, forms={2: "transposed"})
    assert same(clover.generate(ids, max_new_tokens=24, do_sample=False), ref)
    assert clover.generation_stats.verified_per_step > 1.5  # "auto" drafts where verifying more costs nothing
    one = clover._resolve_budget("one-token")
    assert one.widest == 1 and one.fixed is clover._draft_budget.fixed
    assert FormBook.of(one) is FormBook.of(clover._draft_budget)  # the same forms and weight copies
    assert same(clover.generate(ids, max_new_tokens=24, do_sample=False, budget="one-token"), ref)
    stats = clover.generation_stats
    assert stats.verified_per_step == 1.0 and stats.head_drafts == 0 and stats.steps == 24
    assert clover._draft_budget.widest is None  # the view changed nothing of "auto"
    with pytest.raises(ValueError, match="one-token"):
        clover.generate(ids, max_new_tokens=4, budget="none")


def test_weight_copies_setting_is_checked_and_keys_the_costs():
    with pytest.raises(ValueError, match="weight_copies"):
        DraftBudget(weight_copies=-1)
    with pytest.raises(ValueError, match="widest"):
        DraftBudget(widest=0)
    assert FormBook(weight_copies=False).copy_limit() == 0 and FormBook(weight_copies=123).copy_limit() == 123
    assert FormBook().copy_limit() > 0  # half of the memory available
    model = tiny_model("llama")
    assert machine_key(model, True) != machine_key(model, False)


def test_first_steps_stop_learning_wider_widths_once_one_costs_three_one_token_steps():
    import time

    from clover_hf.decode.acceptance import AcceptanceModel
    from clover_hf.decode.choosing import EXPLORE_LIMIT, StepBudget

    budget = DraftBudget(cache_dir="unused")  # nothing is saved here
    step = StepBudget(budget, "k", CostModel(), AcceptanceModel(3, 4), depth=3, lookup_max=4, explore=[1, 2, 4, 8])
    for width, ms in ((1, 10.0), (2, 12.0), (4, 10.0 * EXPLORE_LIMIT + 5.0)):
        assert step.explore[0] == width
        step.exploring = bool(step.explore)
        step.verified(1, width, time.perf_counter() - 1.0, settled=False)  # a step that compiled: explored again
        assert step.explore[0] == width
        step.verified(1, width, time.perf_counter() - ms / 1000)
    assert step.explore == [] and set(step.costs.ms[1]) == {1, 2, 4}  # 8 is left untimed: dearer still
    assert step.costs.ms[1][4] >= 10.0 * EXPLORE_LIMIT


def test_widths_timed_while_the_forms_were_learnt_are_timed_again_once_steps_run_in_settled_forms():
    """A provisional step (its forward still learning the linear forms, or making weight copies) is timed as it
    ran, and does not stop the exploring of wider widths. A settled step of such a width replaces its cost. Once a
    settled step of as many tokens or more runs (or the forms' copies are all made: `forms_ready`), a wider width's
    cost is forgotten and explored again (a step that made copies took up to 10x its cost), one token's doubted
    most (every choice needs it) and explored first. A narrower settled step proves nothing of the wider one's
    products; a provisional step leaves a settled cost alone."""
    import time

    from clover_hf.decode.acceptance import AcceptanceModel
    from clover_hf.decode.costs import MAX_DOUBT
    from clover_hf.decode.choosing import EXPLORE_LIMIT, StepBudget

    budget = DraftBudget(cache_dir="unused")
    step = StepBudget(budget, "k", CostModel(), AcceptanceModel(3, 4), depth=3, lookup_max=4, explore=[1, 4, 8])
    for width, ms in ((1, 30.0), (4, 10.0 * EXPLORE_LIMIT + 5.0)):
        step.exploring = True
        step.verified(1, width, time.perf_counter() - ms / 1000, provisional=True)
    costs = step.costs
    assert step.explore == [8]  # a dear width timed provisionally does not rule out wider ones
    step.exploring = False
    step.verified(1, 1, time.perf_counter() - 0.010)  # settled, but one token: replaces one token's cost only
    assert step.provisional == {(1, 4)} and 4 in costs.ms[1] and costs.staleness(1, 4) < 1.0
    assert costs.ms[1][1] == pytest.approx(10.0, rel=0.2)  # not 30 averaged with 10
    step.forms_ready()
    assert 4 not in costs.ms[1] and step.explore == [4, 8] and not step.provisional
    step.verified(1, 1, time.perf_counter() - 0.090, provisional=True)  # a copy made in a one-token step
    assert costs.ms[1][1] == pytest.approx(10.0, rel=0.2) and not step.provisional  # a settled cost is not made dearer
    costs.provisional.add((1, 1))  # one token's cost timed provisionally, as a first call's one-token steps are
    step.exploring = True
    step.verified(1, 4, time.perf_counter() - 0.011)  # settled: one token's cost is doubted and explored first
    assert step.explore == [1, 8] and not step.provisional
    assert costs.staleness(1, 1) == 1.0 and costs.price(1, 1) == pytest.approx((1 - MAX_DOUBT) * costs.predict(1, 1))
    costs.observe(1, 1, 10.0)  # timed again: the doubted cost is replaced, not averaged with
    assert costs.ms[1][1] == pytest.approx(10.0)


def test_a_step_verifies_the_width_the_form_trials_learn_at_most_learn_steps_a_call():
    """`StepBudget.learn` puts the form trials' width first among those explored (whatever its cost), unless
    steps verify one token for now (`cap`), at most LEARN_STEPS steps a call: forms that never settle must not
    hold a call's steps at that width."""
    from clover_hf.decode.acceptance import AcceptanceModel
    from clover_hf.decode.choosing import LEARN_STEPS, StepBudget

    step = StepBudget(DraftBudget(cache_dir="unused"), "k", CostModel({1: {1: 1.0, 4: 500.0}}), AcceptanceModel(3, 4),
                      depth=3, lookup_max=4, explore=[8])
    step.learn(None)
    step.cap = 1
    step.learn(4)
    assert step.explore == [8]
    step.cap = None
    for _ in range(LEARN_STEPS):
        step.learn(4)
        assert step.explore == [4, 8]
        step.explore.pop(0)  # as a step that verified it takes it off
    step.learn(4)
    assert step.explore == [8]


def test_full_budget_verifies_the_whole_tree_in_the_forms_auto_uses():
    """budget="full": no cut, but the linear forms and weight copies of the model's budget (not F.linear)."""
    base = tiny_model("llama")
    ids = prompt(3)
    ref = base.generate(ids, max_new_tokens=20, do_sample=False)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    steep = CostModel.from_function(lambda rows, width: 10.0 * rows * width, draft_ms=5.0)  # "auto" would not draft
    clover._draft_budget = DraftBudget(costs=steep, forms={n: "float32_copy" for n in (2, 4, 8, 16, 32, 64)})
    full = clover._resolve_budget("full")
    assert not full.cut and FormBook.of(full) is FormBook.of(clover._draft_budget) and clover._draft_budget.cut
    assert same(clover.generate(ids, max_new_tokens=20, do_sample=False, budget="full"), ref)
    assert clover.generation_stats.verified_per_step > len(clover.clover_config.tree) / 2  # the whole tree, uncut
    assert FormBook.of(clover._draft_budget).copies.nbytes > 0  # multiplied from the budget's float32 copies
    assert same(clover.generate(ids, max_new_tokens=20, do_sample=False), ref)
    assert clover.generation_stats.verified_per_step < 2  # "auto" cuts where verifying costs a forward a token


def test_drafting_cost_spread_over_more_tokens_makes_wider_widths_pay():
    """A step's drafting costs the same whatever the width: counted in the rate, it shifts the choice wider."""
    costs = CostModel.from_function(lambda rows, w: 10.0 + 1.0 * w, max_width=16)
    chances = [[0.9, 0.5, 0.3, 0.2, 0.15, 0.1, 0.05, 0.05]]
    narrow, _, _ = choose_width(chances, costs)
    wide, _, ms = choose_width(chances, costs, overhead_ms=20.0)
    assert (narrow, wide) == (5, 7) and ms == pytest.approx(17.0)  # the verify step's own cost
    # where each token costs a forward, the overhead spread over two tokens would tip the choice to a second one;
    # not where the lookup chain alone (no overhead) gets more per ms: the overhead is sunk, the second token is not
    steep = CostModel.from_function(lambda rows, w: 40.0 * w, max_width=16)
    assert choose_width([[0.97, 0.5]], steep, overhead_ms=3.0)[0] == 2
    assert choose_width([[0.97, 0.5]], steep, overhead_ms=3.0, rate_floor=1 / 40)[0] == 1


def _chain_draft(probs: list[float]):
    """A row's draft: its root and a chain of heads' tokens drafted with these probabilities."""
    from clover_hf.decode.drafting import Draft
    from clover_hf.heads.tree import StepTree

    n = len(probs) + 1
    tree = StepTree.from_parents(torch.tensor([0, *range(n - 1)]), torch.arange(n), n - 1)
    return Draft(torch.arange(n), tree, torch.tensor([1.0, *probs]), torch.zeros(n, dtype=torch.bool), 0)


def test_a_batch_times_a_wider_width_only_when_its_drafts_could_pay_for_it():
    """A batch's first steps time an untimed width only on a step whose expected tokens for its last row would pay
    at the cost of one row of as many tokens; otherwise the width leaves this call's list, the step is chosen as
    any other, and one row explores whatever its drafts."""
    import time

    from clover_hf.decode.choosing import StepBudget

    one_row = {1: 10.0, 2: 12.0, 4: 14.0, 8: 20.0}  # 4 rows x 2 tokens: 20 ms against 14 for 4 x 1, 1.43x
    costs = CostModel({1: dict(one_row), 4: {1: 14.0}})

    def step_for(rows: int) -> StepBudget:
        budget = DraftBudget(cache_dir="unused")
        return StepBudget(budget, "k", costs, AcceptanceModel(3, 4), depth=3, lookup_max=4, explore=[2, 4])

    unsure = [_chain_draft([0.6, 0.5, 0.4]) for _ in range(4)]  # the last row moves 1 + 0.6^4 + ... tokens
    step = step_for(4)
    cut = step.choose(unsure, False, time.perf_counter(), 0.0, 0, lengths=[10] * 4)
    assert not step.exploring and step.explore == [4] and all(d.tokens.shape[0] == 1 for d in cut)
    sure = [_chain_draft([0.99, 0.99, 0.99]) for _ in range(4)]  # accepted by all four rows: worth 1.43x
    step.acceptance.hits[:] = [1000.0] * len(step.acceptance.hits)  # every bucket proven (rates 0.99)
    step.acceptance.trials[:] = [1000.0] * len(step.acceptance.trials)
    cut = step.choose(sure, False, time.perf_counter(), 0.0, 0, lengths=[10] * 4)
    assert step.exploring and all(d.tokens.shape[0] == 4 for d in cut)
    one = step_for(1)
    one.choose(unsure[:1], False, time.perf_counter(), 0.0, 0, lengths=[10])
    assert one.exploring and one.explore == [2, 4]


def test_the_heads_gate_judges_afresh_once_the_linear_forms_settle():
    """Steps that learn linear forms or make weight copies cost more than they will: pauses judged on them are
    forgotten once the forms settle (within the call, or as a later call starts settled); pauses judged on
    settled steps stand."""
    import time

    from clover_hf.decode.choosing import StepBudget

    budget = DraftBudget(costs=FLAT)
    gate = budget.gate

    def start(settled: bool) -> StepBudget:
        return StepBudget(budget, "k", FLAT, AcceptanceModel(3, 4), depth=3, lookup_max=4, forms_settled=settled)

    step = start(settled=False)
    step.choose([_chain_draft([0.5, 0.4])], True, time.perf_counter(), 0.0, 0, lengths=[10])  # the heads drafted
    assert gate.unsettled
    settled = start(settled=True)
    assert not gate.unsettled
    settled.choose([_chain_draft([0.5, 0.4])], True, time.perf_counter(), 0.0, 0, lengths=[10])
    assert not gate.unsettled
    gate.pause, gate.next_pause, gate.gain, gate.unsettled = 40, 80, -0.01, True
    step = start(settled=False)
    assert step.gate is gate and gate.pause == 40  # still learning: the judgement stands meanwhile
    step.forms_ready()
    assert (gate.pause, gate.next_pause, gate.gain, gate.draft_ms, gate.unsettled) == (0, MIN_PAUSE, None, None, False)
    gate.pause, gate.next_pause, gate.unsettled = 40, 80, True
    start(settled=True)  # a later call, its forms settled
    assert (gate.pause, gate.next_pause) == (0, MIN_PAUSE)
    gate.pause, gate.next_pause = 40, 80  # judged on settled steps
    start(settled=True).forms_ready()
    assert (gate.pause, gate.next_pause) == (40, 80)


def test_a_first_timing_of_a_width_counts_at_most_twice_what_narrower_widths_predict():
    """One stalled step timed as a width's first cost must not price it out: it counts at most OUTLIER times the
    narrower widths' prediction (proportional past the widest); with nothing narrower timed it stands as timed."""
    from clover_hf.decode.costs import OUTLIER

    costs = CostModel()
    costs.record(1, 1, 10.0)
    costs.record(1, 2, 11.0)
    costs.record(1, 4, 60.0)  # a stall
    assert costs.ms[1][4] == OUTLIER * 11.0 * 4 / 2
    costs.record(1, 3, 12.0)  # within what the curve predicts: kept as timed
    assert costs.ms[1][3] == 12.0
    alone = CostModel()
    alone.record(1, 4, 60.0)
    assert alone.ms[1][4] == 60.0


def test_forms_whose_verify_costs_exceed_a_wider_row_count_in_the_copy_form_switch_to_it(tmp_path):
    """Timed verify forwards that show a row count's form dearer than a wider one's copy form (float32 on the
    AVX-512-bf16 EPYC: W @ x.T at 2-6 tokens 28.9-40.9 ms, oneDNN's blocked layout at 8 tokens 28.4) switch it to the
    copy form, and drop its widths' costs (every row count's) to be timed again; forms still pending, forms without a
    copy form, and curves without an inversion stay."""
    forms = {1: "packed", 2: "transposed", 4: "transposed", 8: "packed", 16: "packed"}
    curve = {1: 20.4, 2: 28.9, 3: 33.1, 4: 32.7, 6: 40.9, 7: 56.0, 8: 28.4, 12: 28.0, 16: 29.0}

    def book_of(forms, **stored) -> FormBook:
        book = FormBook(cache_dir=tmp_path)
        book._machines["m"] = MachineForms(forms=dict(forms), **stored)
        return book

    book, costs = book_of(forms), CostModel({1: dict(curve), 2: {1: 30.0, 2: 35.0, 4: 40.0}})
    assert book.correct_inverted("m", costs) == [2, 4]
    assert book.stored("m").forms == {1: "packed", 2: "packed", 4: "packed", 8: "packed", 16: "packed"}
    assert FormBook(cache_dir=tmp_path).stored("m").forms == book.stored("m").forms  # stored
    assert costs.ms == {1: {1: 20.4, 8: 28.4, 12: 28.0, 16: 29.0}, 2: {4: 40.0}}
    assert book.correct_inverted("m", costs) == []
    book, one_row = book_of({1: "native", 2: "tiled", 4: "tiled"}), CostModel({1: {1: 13.5, 2: 11.6, 4: 12.6, 8: 14.1}})
    assert book.correct_inverted("m", one_row) == [1] and book.stored("m").forms[1] == "tiled" and 1 not in one_row.ms[1]
    sane = {**curve, 2: 21.0, 3: 22.0, 4: 23.0, 6: 25.0, 7: 27.0}  # narrower widths cheaper: the forms stay
    for book, kept in ((book_of(forms), CostModel({1: dict(sane)})),
                       (book_of(forms, pending=[16]), CostModel({1: dict(curve)})),
                       (book_of({**forms, 1: "native", 8: "linear", 16: "linear"}), CostModel({1: dict(curve)}))):
        before = (dict(book.stored("m").forms), {r: dict(c) for r, c in kept.ms.items()})
        assert book.correct_inverted("m", kept) == [] and (book.stored("m").forms, kept.ms) == before


def test_heads_gate_stops_heads_that_cost_more_than_their_deepest_draft_could_save():
    """Two drafting steps in a row dearer than the one-token steps their deepest draft would save, were all of it
    accepted, pause the heads at once for as long as a pause lasts; cheaper drafting is judged as before; a restart
    forgets it."""
    from clover_hf.decode.budget import MAX_PAUSE

    gate = HeadsGate()
    gate.beyond_gain(draft_ms=7.0, steps_saved=4, step_ms=2.0)  # could save 8 ms: judged over steps as before
    assert not gate.hopeless and gate.drafting()
    gate.beyond_gain(draft_ms=9.0, steps_saved=4, step_ms=2.0)  # one dear step (a first draft makes copies)
    assert not gate.hopeless and gate.drafting()
    gate.beyond_gain(draft_ms=1.0, steps_saved=4, step_ms=2.0)
    gate.beyond_gain(draft_ms=9.0, steps_saved=4, step_ms=2.0)  # not two in a row
    assert not gate.hopeless
    gate.beyond_gain(draft_ms=9.0, steps_saved=4, step_ms=2.0)
    assert gate.hopeless and gate.pause == gate.next_pause == MAX_PAUSE and not gate.drafting()
    gate.restart()
    assert not gate.hopeless and gate.drafting()
    # heads with a running cost of drafting that pays: two stalls in a row of one-level drafts count at that cost
    gate.record(draft_ms=2.0, augment_ms=0.0, tokens=2.0, verify_ms=10.0, rate_without=0.1)
    gate.beyond_gain(draft_ms=30.0, steps_saved=1, step_ms=10.0)
    gate.beyond_gain(draft_ms=30.0, steps_saved=1, step_ms=10.0)
    assert not gate.hopeless and gate.dear == 0


def test_a_first_call_stops_drafting_with_heads_that_can_never_pay(tmp_path):
    """Heads whose drafting takes longer than the steps it could ever save (untrained heads drafting from a large
    vocabulary, here made slow) draft only a few times in a first call, which learns its costs from its own steps:
    neither the gate's judging nor the widths it explores keep them drafting (without the bound they drafted on 16
    of 36 steps here). Output stays as plain decoding's in float32 (tested throughout): bf16 here, where no form
    trials hold a first call to one-token steps."""
    import time

    base = tiny_model("llama", dtype=torch.bfloat16)
    ids = prompt(3)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=0)
    draft = clover.clover_heads.draft
    clover.clover_heads.draft = lambda *args, **kwargs: time.sleep(0.25) or draft(*args, **kwargs)
    budget = DraftBudget(cache_dir=tmp_path)
    clover.generate(ids, max_new_tokens=40, do_sample=False, budget=budget)
    assert clover.generation_stats.head_drafts <= 5
