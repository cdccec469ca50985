"""Linear forms learnt from a call's own products: nothing timed apart, exact output, what settles and when."""

from __future__ import annotations

import pytest
import torch

import clover_hf.cpu.binding as binding
import clover_hf.cpu.form_trials as form_trials
from clover_hf import CloverForCausalLM, DraftBudget
from clover_hf.cpu.form_trials import COVERAGE, SAMPLES, FormTrials, row_bucket
from clover_hf.cpu.binding import linear_forms
from clover_hf.cpu.linears import WeightCopies
from clover_hf.cpu.products import COPIES, LINEAR, NATIVE, PACK_ROWS, TRANSPOSED
from clover_hf.backends import FormBook
from clover_hf.backends.kernel_forms import FORMS_FILE, MachineForms, basis
from clover_hf.decode.costs import CostModel, load_costs

from .tiny import CrossAttentionProjections, prompt, same, tiny_model


class FakeClock:
    """A clock that moves only when a product is computed: by `ms(rows, form)` milliseconds."""

    def __init__(self, ms) -> None:
        self.now, self.ms = 0.0, ms

    def __call__(self) -> float:
        return self.now


def fake_products(monkeypatch, clock: FakeClock) -> list[tuple[int, str]]:
    """Products in the trials compute as usual, and advance `clock` by `clock.ms(rows, form)`; returns them."""
    done = []
    real = form_trials.form_linear

    def product(x, weight, bias, form, copy=None):
        rows = x.numel() // x.shape[-1]
        done.append((rows, form))
        clock.now += clock.ms(rows, form) / 1000
        return real(x, weight, bias, form, copy)

    monkeypatch.setattr(form_trials, "form_linear", product)
    return done


def copying_trials(model) -> tuple[WeightCopies, FormTrials, str]:
    """The model's form trials on a clock that stands still, with room for every weight copy, and their copy form;
    skips the test where this machine makes no weight copies."""
    copies = WeightCopies(limit=10**9)
    trials = FormTrials([model], copies, plain_row_s=0.050, clock=FakeClock(lambda rows, form: 0.0))
    if trials.copy_kind is None:
        pytest.skip("no weight copies on this machine")
    return copies, trials, trials.copy_kind


def forward_rows(model, rows: int) -> None:
    """One forward of the model over `rows` tokens (a prefill)."""
    with torch.no_grad():
        model(prompt(length=rows))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_a_first_call_learns_the_forms_from_its_own_products_and_stays_exact(arch, monkeypatch, tmp_path):
    """No stored forms: the call times no form apart (faster_forms is not run), its greedy output equals the base's
    in float32 over several calls, and what the products taught is stored with the row counts still pending."""
    import clover_hf.cpu

    monkeypatch.setattr(clover_hf.cpu, "faster_forms", lambda *a, **k: pytest.fail("forms timed apart"))
    base = tiny_model(arch)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    budget = DraftBudget(cache_dir=tmp_path)
    for seed in range(3):
        ids = prompt(seed, length=5 + seed)
        ref = base.generate(ids, max_new_tokens=24, do_sample=False)
        assert same(clover.generate(ids, max_new_tokens=24, do_sample=False, budget=budget), ref)
    (key, stored), = load_forms_all(tmp_path).items()
    assert stored.forms is not None  # learnt (possibly F.linear throughout: then empty)
    trials = FormBook.of(budget)._trials.get(key)
    assert trials is None or stored.pending == sorted(trials.pending)  # pending row counts are kept for later calls
    assert load_costs(key, tmp_path).ms  # the verify costs the calls timed stay
    # each settled row count's fastest form without a copy, for a new process's products until its copies are made
    assert set(stored.fallbacks or {}) == set(form_trials.ROW_COUNTS) - set(stored.pending or ())


def test_a_first_call_verifies_one_token_a_step_until_it_is_ahead_of_plain_enough_to_learn_wider_forms(
        monkeypatch, tmp_path):
    """While wider forms are still to be learnt, a call verifies one token a step until it runs ahead of plain
    `generate` by RESERVE_STEPS one-token forwards (learning them costs more than a short answer earns back); a
    call that gets ahead learns them, drafting again. Greedy output stays the base's either way."""
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    budget = DraftBudget(cache_dir=tmp_path)
    ids = prompt(3)
    ref = base.generate(ids, max_new_tokens=24, do_sample=False)
    monkeypatch.setattr(form_trials, "RESERVE_STEPS", 1e9)  # never far enough ahead
    assert same(clover.generate(ids, max_new_tokens=24, do_sample=False, budget=budget), ref)
    stats = clover.generation_stats
    assert stats.verified_per_step == 1.0 and stats.head_drafts == 0
    assert stats.learning_steps == len(stats.accepted_lengths) > 0  # every verify step, while the forms were learnt
    (trials,) = FormBook.of(budget)._trials.values()
    assert {2, 4, 8, 16} <= trials.pending and trials.one_token_steps()
    assert trials.plain_row_s is not None and trials.tokens == 23  # the tokens after the prefill's
    monkeypatch.setattr(form_trials, "RESERVE_STEPS", -1e9)  # always ahead enough
    assert same(clover.generate(ids, max_new_tokens=24, do_sample=False, budget=budget), ref)
    assert clover.generation_stats.verified_per_step > 1.0 and not trials.one_token_steps()


def test_a_call_learns_only_while_ahead_of_plain_by_its_reserve():
    """What the call is ahead of plain `generate` by: plain's prefill (the call's own) and a one-token forward in
    F.linear per token (at PLAIN_SHARE of its timed time), less the call's time. It learns while that holds
    RESERVE_STEPS forwards; what it spends brings it back to one-token steps, and a call that falls behind never
    learns, however long it runs."""
    model = tiny_model("llama")
    clock = FakeClock(None)
    trials = FormTrials([model], WeightCopies(), clock=clock)
    trials.next_call()
    trials.prefilled(0.05)
    clock.now += 0.05
    for _ in range(3):  # before plain's one-token forward is timed, nothing is known
        trials.emitted(1)
        clock.now += 0.015
    assert trials.ahead_s() is None and trials.one_token_steps()
    trials.plain_row_s = 0.025 / form_trials.PLAIN_SHARE  # plain 25 ms a token, the call's one-token steps 15
    assert trials.ahead_s() == pytest.approx(3 * 0.010)
    while trials.one_token_steps():
        trials.emitted(1)
        clock.now += 0.015
    reserve = form_trials.RESERVE_STEPS * trials.plain_row_s
    assert trials.ahead_s() >= reserve > trials.ahead_s() - 0.010
    clock.now += 0.040  # a dear wide step in forms being timed, for one token
    trials.emitted(1)
    assert trials.one_token_steps()
    clock.now += 60.0  # a long call, behind plain
    assert trials.one_token_steps() and trials.width_to_learn() is None


def test_a_call_whose_forms_become_ready_runs_its_remaining_steps_outside_the_trials(monkeypatch, tmp_path):
    """A step whose verify forward had any of its products computed by the trials (in a form being timed, or in a
    settled one: the trials compute a layer at a time, outside the decoder layers' one kernel call) is provisional. Bound as the call
    began, the layers' products of the row counts it learnt ran through the trials to its end; once the forms are
    ready, the call binds them again, and its remaining steps compute none there. Greedy output stays the base's."""
    from clover_hf.base.verify_forward import VerifyForward
    from clover_hf.decode.choosing import StepBudget

    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    ids = prompt(3, length=20)
    ref = base.generate(ids, max_new_tokens=80, do_sample=False)
    monkeypatch.setattr(form_trials, "RESERVE_STEPS", -1e9)  # always ahead of plain: the call may learn
    budget = DraftBudget(cache_dir=tmp_path)
    # products the trials computed in the step's verify forward (the part of a step that is timed: the heads' drafting
    # before it may compute some too); per step (those, provisional, ready, width)
    through, steps, verifying = [0], [], [False]
    real_product, real_verified, real_verify = FormTrials.product, StepBudget.verified, VerifyForward.__call__

    def product(self, layer, x, rows):
        through[0] += verifying[0]
        return real_product(self, layer, x, rows)

    def verify(self, *args, **kwargs):
        through[0], verifying[0] = 0, True
        try:
            return real_verify(self, *args, **kwargs)
        finally:
            verifying[0] = False

    def verified(self, rows, width, started, settled=True, provisional=False):
        (trials,) = FormBook.of(budget)._trials.values()
        steps.append((through[0], provisional, trials.ready(), width))
        through[0] = 0
        return real_verified(self, rows, width, started, settled, provisional)

    monkeypatch.setattr(FormTrials, "product", product)
    monkeypatch.setattr(StepBudget, "verified", verified)
    monkeypatch.setattr(VerifyForward, "__call__", verify)
    assert same(clover.generate(ids, max_new_tokens=80, do_sample=False, budget=budget), ref)
    ready = [i for i, (_, _, now, _) in enumerate(steps) if now]
    assert ready and ready[0] < len(steps) - 1  # ready within the call, with steps after it
    assert all(provisional == (n > 0) for n, provisional, _, _ in steps)
    # (a step of more tokens than a verify forward's row counts computes in a prefill's, which may still be learnt)
    assert steps[ready[0]][0] > 0 and all(n == 0 for n, _, _, width in steps[ready[0] + 1:] if width <= PACK_ROWS)


def test_the_width_to_learn_is_the_narrowest_verify_row_count_pending_while_the_call_may_learn():
    """A step verifies the narrowest row count a verify forward has still to learn (above one: one-token steps learn
    one row), once the call may spend on learning; a prefill's wider row counts are left to prefills."""
    clock = FakeClock(None)
    trials = FormTrials([tiny_model("llama")], WeightCopies(), plain_row_s=0.025, clock=clock)
    trials.next_call()
    assert trials.width_to_learn() is None  # not ahead of plain
    trials.emitted(10)  # ten tokens in no time: ahead by ten of plain's forwards
    assert trials.width_to_learn() == 2
    trials.pending -= {1, 2}
    assert trials.width_to_learn() == 4
    trials.pending -= set(range(PACK_ROWS + 1))
    assert trials.pending and trials.width_to_learn() is None


def load_forms_all(cache_dir) -> dict[str, MachineForms]:
    import json

    data = json.loads((cache_dir / FORMS_FILE).read_text())
    return {k: FormBook(cache_dir=cache_dir).stored(k) for k in data}


def store_forms(key: str, stored: MachineForms, cache_dir) -> None:
    book = FormBook(cache_dir=cache_dir)
    book._machines[key] = stored
    book.save(key)


def test_a_row_count_settles_on_the_form_its_products_took_least_time_in(monkeypatch):
    """With W @ x.T timed at half F.linear's time, every row count a forward runs at settles on it once each
    shape has SAMPLES timings of each form (the first product of a shape in a form is not timed)."""
    model = tiny_model("llama")
    clock = FakeClock(lambda rows, form: {LINEAR: 1.0, TRANSPOSED: 0.5}.get(form, 2.0) * rows)
    done = fake_products(monkeypatch, clock)
    trials = FormTrials([model], WeightCopies(), clock=clock)
    with linear_forms([model], {}, None, trials):
        for _ in range(2 * (SAMPLES + 1)):  # the output embedding runs once a forward
            forward_rows(model, 1)
            forward_rows(model, 5)
    assert {1, 4} <= set(trials.totals) and not {1, 4} & trials.pending
    assert trials.forms.get(4) == TRANSPOSED
    assert all(rows in (1, 5) for rows, _ in done)
    # one row takes W @ x.T only where the weights are float32 (a half one would be ATen's slow product)
    assert trials.forms.get(1) == TRANSPOSED
    for rows in (1, 5):  # settled: no more trials, each product in the settled form
        done.clear()
        with linear_forms([model], {}, None, trials):
            forward_rows(model, rows)
        assert {form for _, form in done} == {TRANSPOSED}


def test_a_row_count_stays_pending_until_the_shapes_timed_hold_most_of_the_bytes(monkeypatch):
    """Products of a small layer alone (some of the heads' at odd row counts) do not settle a row count for the
    base's large ones: it waits until the shapes timed there cover COVERAGE of the weights' bytes."""
    model = tiny_model("llama")
    small = torch.nn.Linear(8, 8)
    clock = FakeClock(lambda rows, form: 1.0 if form == LINEAR else 0.5)
    fake_products(monkeypatch, clock)
    trials = FormTrials([model, torch.nn.Sequential(small)], WeightCopies(), clock=clock)
    assert small.weight.nbytes < (1 - COVERAGE) * trials.total_bytes
    with linear_forms([model, torch.nn.Sequential(small)], {}, None, trials), torch.no_grad():
        for _ in range(4 * SAMPLES * len(trials.candidates[2])):
            small(torch.randn(2, 8))
    assert 2 in trials.pending and 2 not in trials.forms
    with linear_forms([model, torch.nn.Sequential(small)], {}, None, trials):
        for _ in range(2 * (SAMPLES + 1)):
            forward_rows(model, 2)
    assert 2 not in trials.pending


def test_a_prefill_learns_its_row_count_once_the_verify_forms_are_ready(monkeypatch):
    """A prefill's row count (above PACK_ROWS) computes in F.linear, as plain's, while the verify forms are being
    learnt (a prefill comes before the call may learn); once they are ready, the prefills of later calls time
    the forms and settle it, and the prefills after those compute in the form settled."""
    model = tiny_model("llama")
    clock = FakeClock(lambda rows, form: {LINEAR: 1.0, TRANSPOSED: 0.25}.get(form, 2.0) * rows)
    done = fake_products(monkeypatch, clock)
    trials = FormTrials([model], WeightCopies(), clock=clock)
    prefill = 2 * PACK_ROWS + 3
    trials.next_call()
    with linear_forms([model], {}, None, trials):
        forward_rows(model, prefill)
    assert not done and row_bucket(prefill) in trials.pending  # F.linear, untimed (outside the trials)
    trials.pending -= {n for n in range(PACK_ROWS + 1)}  # the verify forms settled (on F.linear: no copies)
    assert trials.ready()
    asked = []
    real_handles = trials.handles
    monkeypatch.setattr(trials, "handles", lambda rows: asked.append(rows) or real_handles(rows))
    with linear_forms([model], trials.forms, None, trials):
        forward_rows(model, 4)  # a verify forward: the forms compute it, the trials are not even asked
    assert not asked and not done
    calls = 0
    while row_bucket(prefill) in trials.pending:
        calls += 1
        assert calls <= 2 * (SAMPLES + 1)
        trials.next_call()
        with linear_forms([model], {}, None, trials):
            forward_rows(model, prefill)
    assert trials.forms[row_bucket(prefill)] == TRANSPOSED
    done.clear()
    bound = []
    real = binding.form_product
    monkeypatch.setattr(binding, "form_product", lambda form, *a, **k: bound.append(form) or real(form, *a, **k))
    trials.next_call()
    with linear_forms([model], trials.forms, None, trials):
        forward_rows(model, prefill)
    assert not done and set(bound) == {TRANSPOSED}  # settled: computed outside the trials, in its form


def test_a_prefill_times_the_copy_form_on_layers_a_stacked_copy_holds(monkeypatch):
    """Where the verify forms settled on copies, a layer whose group computes from one stacked copy (q/k/v,
    gate/up) gets a copy of its own to be timed at a prefill's row count, though the call may not copy yet: else
    those shapes were never timed in the copy form, and the row count never settled (F.linear prefills for good)."""
    from clover_hf.cpu.linears import onednn_packs

    if not onednn_packs():
        pytest.skip("this torch build has no oneDNN: no blocked copies")  # every x86 CPU wheel has it
    model = tiny_model("llama")
    clock = FakeClock(lambda rows, form: (0.2 if form in COPIES else 1.0) * rows)
    fake_products(monkeypatch, clock)
    copies = WeightCopies(limit=10**9)
    trials = FormTrials([model], copies, plain_row_s=0.050, clock=clock)
    kind = trials.copy_kind
    trials.pending -= {n for n in range(PACK_ROWS + 1)}
    trials.forms.update({n: kind for n in (1, 2, 4, 8, 16)})
    copies.prepare_units(trials.units, kind)
    trials.next_call()
    with linear_forms([model], trials.forms, copies, trials):
        forward_rows(model, 2)  # a verify forward: the copies serve every layer
    assert trials.ready() and copies.stacked  # the groups compute from stacked copies
    prefill = 2 * PACK_ROWS + 3
    for _ in range(2 * (SAMPLES + 1)):
        if row_bucket(prefill) not in trials.pending:
            break
        trials.next_call()
        assert not trials.may_learn()
        with linear_forms([model], trials.forms, copies, trials):
            forward_rows(model, prefill)
    assert trials.forms.get(row_bucket(prefill)) == kind
    grouped = {trials.shape_of[id(m)] for m in copies.stacked}
    assert all(trials.ms[(row_bucket(prefill), shape)][kind] for shape in grouped)
    assert not trials.timing_copies  # the copies made for the timing alone are dropped once it settles


def test_a_form_far_behind_is_timed_once_and_atens_kernel_only_at_one_row(monkeypatch):
    """A form whose one timing takes NATIVE_BEHIND times the best other's is not timed again for that shape;
    ATen's kernel is tried at one row only (whole forwards of 2-3 tokens ran slower with it)."""
    model = tiny_model("llama")
    clock = FakeClock(lambda rows, form: {LINEAR: 1.0, TRANSPOSED: 10.0}.get(form, 1.0))
    done = fake_products(monkeypatch, clock)
    trials = FormTrials([model], WeightCopies(), clock=clock)
    with linear_forms([model], {}, None, trials):
        for _ in range(4):
            forward_rows(model, 3)
    shapes = len(set(trials.shape_of.values()) - {s for s in trials.shape_of.values() if s[1]})
    slow = sum(form == TRANSPOSED for rows, form in done if rows == 3)
    assert slow <= 2 * (shapes + 1)  # per shape: one untimed first product, one timed
    assert trials.forms.get(2) != TRANSPOSED
    assert all(NATIVE not in trials.candidates[n] for n in trials.candidates if n > 1)


def test_copies_are_made_one_layer_at_a_time_while_the_call_is_ahead_of_plain(monkeypatch):
    """A copy form is timed from copies made as products need them, one layer at a time, while the call is ahead
    of plain `generate` by its reserve (what it spends on them brings it back); where none may be made, other
    forms are timed."""
    from clover_hf.cpu.linears import onednn_packs

    if not onednn_packs():
        pytest.skip("this torch build has no oneDNN: no blocked copies")  # every x86 CPU wheel has it
    model = tiny_model("llama")
    # copies pay from 2 rows (timed at 0.2x F.linear), not at one (5x)
    clock = FakeClock(lambda rows, form: (0.2 if rows > 1 else 5.0) if form in COPIES else 1.0)
    done = fake_products(monkeypatch, clock)
    copies = WeightCopies(limit=10**9)
    made = []
    real = copies.prepare

    def prepare(layers, form):
        made.append(len(list(layers)))
        clock.now += 0.005  # 5 ms a copy
        real(layers, form)

    monkeypatch.setattr(copies, "prepare", prepare)
    trials = FormTrials([model], copies, plain_row_s=0.050, clock=clock)  # plain: 50 ms a token
    assert trials.copy_kind in COPIES
    trials.next_call()
    reserve = form_trials.RESERVE_STEPS * trials.plain_row_s
    with linear_forms([model], {}, copies, trials):
        for _ in range(5):  # no token yet: behind plain, no copy
            forward_rows(model, 4)
        assert not made and copy_form_timed(done, trials) == 0
        for _ in range(40):  # a token a forward, each forward's products taking less than plain's 50 ms
            trials.emitted(1)
            before = len(made)
            forward_rows(model, 4)
            if len(made) > before:  # made while ahead by the reserve: at most the last copy and products past it
                assert trials.ahead_s() >= reserve - 0.020
    assert made and set(made) == {1}  # one layer at a time
    assert trials.forms.get(4) == trials.copy_kind  # timed at 0.2x F.linear: chosen
    # every product makes the copy its layer (or group) will compute from, whatever form it takes itself, until
    # all are made: else only wide steps would make them
    done.clear()
    with linear_forms([model], {}, copies, trials):
        for _ in range(200):
            if trials.copied():
                break
            trials.emitted(1)
            forward_rows(model, 1)
    in_copies = sum(form == trials.copy_kind for _, form in done)  # one row: timed once per shape, then dropped
    assert trials.copied() and in_copies < len(trials.units)


def copy_form_timed(done: list[tuple[int, str]], trials: FormTrials) -> int:
    return sum(form == trials.copy_kind for _, form in done)


def test_stored_forms_and_pending_row_counts_survive_the_cache_file(tmp_path):
    from clover_hf.decode.costs import save_costs

    store_forms("m", MachineForms(forms={1: "native", 4: "packed"}, pending=[32, 64], plain_row_ms=4.5,
                                  fallbacks={1: "native", 4: "transposed"}), tmp_path)
    save_costs("m", CostModel({1: {1: 5.0}}, basis="b", provisional={(1, 4), (4, 2)}), tmp_path)
    loaded, costs = FormBook(cache_dir=tmp_path).stored("m"), load_costs("m", tmp_path)
    assert loaded.forms == {1: "native", 4: "packed"} and loaded.pending == [32, 64] and loaded.plain_row_ms == 4.5
    assert loaded.fallbacks == {1: "native", 4: "transposed"}
    assert costs.ms == {1: {1: 5.0}} and costs.basis == "b" and costs.provisional == {(1, 4), (4, 2)}


def test_forms_learnt_keep_the_verify_costs_and_end_once_every_row_count_settles(tmp_path):
    """Trials settle only on forms faster than the costs were timed under: the costs stay. Once every row
    count up to PACK_ROWS settled, the wider ones (a prefill's) stay pending and the trials go on; they end
    once those settle too."""
    model = tiny_model("llama")
    budget = DraftBudget(cache_dir=tmp_path)
    book = FormBook.of(budget)
    trials = book.form_trials("m", None, [model], None)
    assert trials is not None and book.form_trials("m", False, [model], None) is None  # calibrate=False: never
    budget.stored("m").ms = {1: {1: 9.0, 4: 12.0}}
    budget.rebase("m", basis(trials.forms), keep=True)
    trials.pending -= {1, 2, 4}
    trials.forms[4] = TRANSPOSED
    book.keep_learnt("m", trials)
    budget.rebase("m", basis(trials.forms), keep=True)  # as the call ends (`KernelBackend.finish`)
    stored = book.stored("m")
    assert stored.forms == {4: TRANSPOSED} and budget.stored("m").ms == {1: {1: 9.0, 4: 12.0}} and 8 in stored.pending
    assert book.form_trials("m", None, [model], None) is trials  # the same trials go on in the next call
    trials.pending -= {n for n in range(PACK_ROWS + 1)}
    book.keep_learnt("m", trials)
    assert book.stored("m").pending == [32, 64, 128, 256] and not book.stored("m").verify_pending()
    assert book.form_trials("m", None, [model], None) is trials
    trials.pending.clear()
    book.keep_learnt("m", trials)
    assert book.stored("m").pending is None and book.form_trials("m", None, [model], None) is None
    budget.rebase("m", basis(book.stored("m").forms))  # the next call: the forms the costs were timed in
    assert budget.stored("m").ms == {1: {1: 9.0, 4: 12.0}}


def test_a_verify_row_count_still_to_learn_is_verified_though_its_widths_were_timed_dear(monkeypatch, tmp_path):
    """Widths timed while their forms were still being learnt can look so dear that the choice by cost never
    verifies them again: their row count then stayed pending for good, and every later call ran steps in forms
    being timed. A call that may learn verifies the narrowest pending row count (`StepBudget.learn`) until it
    settles. Costs stored as timed provisionally are timed again once a step runs settled at as many tokens or
    more, in a later call too. Greedy output stays the base's."""
    from clover_hf.decode.costs import save_costs

    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    ids = prompt(3, length=20)  # its prefill's 20 rows learn row count 16, not 4
    ref = base.generate(ids, max_new_tokens=40, do_sample=False)
    monkeypatch.setattr(form_trials, "RESERVE_STEPS", -1e9)  # always ahead of plain: the calls may learn
    assert same(clover.generate(ids, max_new_tokens=40, do_sample=False, budget=DraftBudget(cache_dir=tmp_path)), ref)
    (key, forms), = load_forms_all(tmp_path).items()
    forms.forms, forms.fallbacks = {}, dict.fromkeys((1, 2, 8, 16), LINEAR)  # F.linear at the settled row counts
    forms.pending = [4, 32, 64, 128, 256]
    store_forms(key, forms, tmp_path)
    stored = load_costs(key, tmp_path)
    stored.ms = {1: {1: 1.0, 2: 1.1, 3: 1.2, **dict.fromkeys(range(4, 65), 500.0)}}  # every width wider: none explored
    stored.provisional = set()  # as stored before provisional costs were kept
    save_costs(key, stored, tmp_path)
    assert same(clover.generate(ids, max_new_tokens=40, do_sample=False, budget=DraftBudget(cache_dir=tmp_path)), ref)
    assert 4 not in FormBook(cache_dir=tmp_path).stored(key).pending
    costs = load_costs(key, tmp_path)

    costs.ms[1].update({4: 500.0, 6: 500.0})
    costs.provisional = {(1, 4), (1, 6), (4, 2)}  # timed provisionally by an earlier process
    save_costs(key, costs, tmp_path)
    assert same(clover.generate(ids, max_new_tokens=40, do_sample=False, budget=DraftBudget(cache_dir=tmp_path)), ref)
    costs = load_costs(key, tmp_path)
    assert costs.provisional == {(4, 2)}  # another row count's are left to a call of its own
    assert all(costs.ms[1].get(w, 0.0) < 500.0 for w in (4, 6))  # timed again (or left untimed)


def test_a_row_count_is_the_power_of_two_at_or_below_it():
    assert [row_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 300)] == [1, 1, 2, 2, 4, 4, 8, 256]


def test_a_batch_finding_verify_row_counts_still_pending_times_the_forms_apart(tmp_path):
    """Batches do not learn forms from their products (their rows multiply at 4 and more, where trying slow forms
    inside forwards cost more than timing them): one that finds verify row counts still pending after batch-1
    calls times all the forms apart, and then nothing is pending."""
    book = FormBook(cache_dir=tmp_path)
    stored = book.stored("m")
    stored.forms, stored.pending = {1: "native"}, [2, 4, 8, 16, 32]
    assert book.forms("m", None, lambda limit: {2: TRANSPOSED}) == {2: TRANSPOSED}
    assert not book.stored("m").pending
    stored.pending = [64]  # only row counts past a verify forward's pending: kept as learnt
    assert book.forms("m", None, lambda limit: pytest.fail("timed again")) == {2: TRANSPOSED}


def test_one_row_is_learnt_from_whole_forwards_each_in_one_form(monkeypatch):
    """One row is timed by whole one-token forwards (per product, W @ x.T was timed faster in float32 while
    one-token steps ran slower with it): every product of a forward from the base's first layer to its output
    embedding takes one form, each form is timed SAMPLES times after one untimed forward (once where it takes
    NATIVE_BEHIND times another's time), and the fastest settles. The heads' one-row products between forwards
    take the fastest so far. F.linear's forward is plain `generate`'s: its time is kept."""
    model = tiny_model("llama")
    clock = FakeClock(lambda rows, form: {LINEAR: 1.0, TRANSPOSED: 0.5}.get(form, 2.0))
    done = fake_products(monkeypatch, clock)
    trials = FormTrials([model], WeightCopies(), clock=clock)
    per_forward = len(trials.shape_of)
    forwards = (SAMPLES + 1) * len(trials.candidates[1])
    with linear_forms([model], {}, None, trials):
        for _ in range(forwards):
            forward_rows(model, 1)
    assert len(done) == forwards * per_forward
    forms_of = [{form for _, form in done[k:k + per_forward]} for k in range(0, len(done), per_forward)]
    assert all(len(forms) == 1 for forms in forms_of)  # one form a forward
    order = [next(iter(f)) for f in forms_of]
    assert order[:4] == [LINEAR, TRANSPOSED, LINEAR, TRANSPOSED]  # each untimed, then timed in turn
    assert order.count(LINEAR) == 2  # timed once at twice W @ x.T's time: not again
    assert 1 not in trials.pending and trials.forms[1] == TRANSPOSED
    assert trials.totals[1][TRANSPOSED] == pytest.approx(0.5 * trials.totals[1][LINEAR])
    assert trials.plain_row_s == pytest.approx(trials.totals[1][LINEAR] / 1000)


def test_trials_are_ready_once_verify_row_counts_settled_and_their_copies_are_made():
    """The decode loop times again what it timed provisionally once the trials are ready: every row count of a
    verify forward settled, and the copies its forms compute from made (none needed where no form uses them)."""
    model = tiny_model("llama")
    trials = FormTrials([model], WeightCopies(limit=10**9))
    assert not trials.ready()  # nothing settled yet
    trials.pending -= {n for n in range(PACK_ROWS + 1)}
    assert trials.ready()  # F.linear everywhere: no copies to make
    if trials.copy_kind is not None:
        trials.forms[4] = trials.copy_kind
        assert not trials.ready()  # its copies not made yet


def test_a_new_process_makes_the_stored_forms_copies_as_its_calls_get_ahead_of_plain(monkeypatch, tmp_path):
    """Forms stored by an earlier process that compute from weight copies: a new process makes none as its first
    call begins (they take a good share of a short call), but as its calls get ahead of plain `generate`; its
    steps verify one token until they are made. Greedy output stays the base's throughout."""
    base, clover, ids, ref, key = _stored_copy_forms(tmp_path, (2, 4, 8, 16))
    budget = DraftBudget(cache_dir=tmp_path)  # a new process: no copies yet
    monkeypatch.setattr(form_trials, "RESERVE_STEPS", 1e9)  # never ahead enough
    assert same(clover.generate(ids, max_new_tokens=24, do_sample=False, budget=budget), ref)
    book = FormBook.of(budget)
    (trials,) = book._trials.values()
    assert trials.providing and book.copies.nbytes == 0
    assert clover.generation_stats.verified_per_step == 1.0  # wide steps would compute without their copies
    monkeypatch.setattr(form_trials, "RESERVE_STEPS", -1e9)  # always ahead enough
    assert same(clover.generate(ids, max_new_tokens=24, do_sample=False, budget=budget), ref)
    assert book.copies.nbytes > 0 and trials.copied() and not book._trials  # made: the trials end
    assert book.form_trials(key, None, [base, clover.clover_heads], None) is None
    assert same(clover.generate(ids, max_new_tokens=24, do_sample=False, budget=budget), ref)
    assert clover.generation_stats.learning_steps == 0  # the forms and their copies are all there


def _stored_copy_forms(tmp_path, rows: tuple[int, ...], fallbacks: dict[int, str] | None = None):
    """A tiny llama, its Clover model, a prompt, the base's greedy output, and the key of forms stored as an earlier
    process would, computing from oneDNN's blocked copies at these row counts, with these `fallbacks`."""
    from clover_hf.cpu.linears import PACKED, onednn_packs

    if not onednn_packs():
        pytest.skip("this torch build has no oneDNN: no blocked copies")
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    ids = prompt(3)
    ref = base.generate(ids, max_new_tokens=24, do_sample=False)
    assert same(clover.generate(ids, max_new_tokens=24, do_sample=False, budget=DraftBudget(cache_dir=tmp_path)), ref)
    (key, stored), = load_forms_all(tmp_path).items()
    stored.forms = dict.fromkeys(rows, PACKED)
    stored.pending, stored.plain_row_ms, stored.fallbacks = None, 5.0, fallbacks
    store_forms(key, stored, tmp_path)
    return base, clover, ids, ref, key


def test_a_new_process_computes_one_row_in_its_stored_fallback_until_the_copies_are_made(monkeypatch, tmp_path):
    """Where one row's stored form computes from weight copies, a new process computes its one-row products in the
    form stored as the fastest without a copy until the copies are made, not in F.linear: F.linear runs no faster
    than plain `generate`, so the call would never get ahead of plain to make them."""
    base, clover, ids, ref, key = _stored_copy_forms(tmp_path, (1, 2, 4, 8, 16), {1: TRANSPOSED})
    budget = DraftBudget(cache_dir=tmp_path)  # a new process: no copies yet
    monkeypatch.setattr(form_trials, "RESERVE_STEPS", 1e9)  # never ahead enough to make them
    done = []
    real = form_trials.form_linear

    def product(x, weight, bias, form, copy=None):
        done.append((x.numel() // x.shape[-1], form))
        return real(x, weight, bias, form, copy)

    monkeypatch.setattr(form_trials, "form_linear", product)
    assert same(clover.generate(ids, max_new_tokens=24, do_sample=False, budget=budget), ref)
    assert FormBook.of(budget).copies.nbytes == 0 and clover.generation_stats.verified_per_step == 1.0
    one_row = {form for rows, form in done if rows == 1}
    assert one_row == {TRANSPOSED}


def test_forms_stored_without_one_rows_fallback_are_learnt_again_as_on_a_first_call(tmp_path):
    """Forms stored without the form one row takes while its copies are missing (timed apart, or by an earlier
    release) are learnt again as a first call learns them, one row first."""
    base, clover, ids, ref, key = _stored_copy_forms(tmp_path, (1, 2, 4, 8, 16))
    budget = DraftBudget(cache_dir=tmp_path)
    trials = FormBook.of(budget).form_trials(key, None, [base, clover.clover_heads], None)
    assert trials.pending == set(form_trials.ROW_COUNTS) and not trials.forms and trials.one_token_steps()
    assert same(clover.generate(ids, max_new_tokens=24, do_sample=False, budget=budget), ref)


def test_one_row_settles_without_the_copy_form_where_no_wider_row_count_took_it(monkeypatch):
    """One row times the copy form only once every copy is made; where the wider verify row counts all settled on
    forms without copies, none is made, and one row settles on the others."""
    from clover_hf.cpu.linears import onednn_packs

    if not onednn_packs():
        pytest.skip("this torch build has no oneDNN: no blocked copies")
    model = tiny_model("llama")
    clock = FakeClock(lambda rows, form: 1.0)
    fake_products(monkeypatch, clock)
    trials = FormTrials([model], WeightCopies(limit=10**9), known={}, pending={1}, plain_row_s=0.05, clock=clock)
    assert trials.copy_kind in trials.candidates[1]
    trials.next_call()
    with linear_forms([model], {}, trials.copies, trials):
        for _ in range(3 * form_trials.SAMPLES * len(trials.candidates[1])):
            forward_rows(model, 1)
            clock.now += 0.001
            if 1 not in trials.pending:
                break
    assert 1 not in trials.pending and trials.copies.nbytes == 0
    assert trials.fallback[1] not in COPIES


def test_calls_of_one_token_steps_alone_make_the_copies_one_row_is_timed_in(monkeypatch):
    """Calls that verify one token a step (`budget="one-token"`) on a machine with no stored forms: no wider row
    count makes the copy form's copies, so one row makes them (as the call gets ahead of plain), is timed in that
    form too and settles on it where fastest, though by less than the memory rule asks of copies no wider row count
    keeps (`COPY_GAIN`): those are still to try it. Before, one row stayed pending, its products in F.linear."""
    from clover_hf.cpu.linears import onednn_packs

    if not onednn_packs():
        pytest.skip("this torch build has no oneDNN: no blocked copies")
    model = tiny_model("llama")
    # W @ x.T well ahead of F.linear (plain's form): what the call gains there pays for the copies, whose form is 5%
    # faster still
    clock = FakeClock(lambda rows, form: {kind: 57.0, TRANSPOSED: 60.0}.get(form, 100.0))
    trials = FormTrials([model], WeightCopies(limit=10**9), known=None, pending=None, clock=clock)
    kind = trials.copy_kind
    fake_products(monkeypatch, clock)
    assert kind in trials.candidates[1] and 2 in trials.pending
    for call in range(4):
        trials.next_call()
        with linear_forms([model], {}, trials.copies, trials):
            for _ in range(4 * form_trials.SAMPLES * len(trials.candidates[1])):
                forward_rows(model, 1)
                trials.emitted(1)
                if 1 not in trials.pending:
                    break
        if 1 not in trials.pending:
            break
    assert 1 not in trials.pending and trials.forms[1] == kind and trials.copies.nbytes > 0
    assert 2 in trials.pending  # no wider product ran


def test_one_row_still_pending_once_the_copies_are_made_is_learnt_from_one_token_steps(monkeypatch):
    """A call that got ahead of plain learns the wider forms first; once their copies are made, one row (timed in
    the copy form too) is learnt from one-token steps: wide steps would leave it pending for good."""
    from clover_hf.cpu.linears import PACKED, onednn_packs

    if not onednn_packs():
        pytest.skip("this torch build has no oneDNN: no blocked copies")
    model = tiny_model("llama")
    monkeypatch.setattr(form_trials, "RESERVE_STEPS", -1e9)  # always ahead enough to learn and make copies
    trials = FormTrials([model], WeightCopies(limit=10**9), known={n: PACKED for n in (2, 4, 8, 16)}, pending={1},
                        plain_row_s=0.05)
    trials.next_call()
    assert not trials.one_token_steps()  # copies still to make: wide steps make them
    with linear_forms([model], {}, trials.copies, trials):
        forward_rows(model, 4)
        assert trials.copied() and 1 in trials.pending and trials.one_token_steps()
        for _ in range(50):
            forward_rows(model, 1)
            if 1 not in trials.pending:
                break
    assert 1 not in trials.pending and not trials.one_token_steps()


def test_a_group_seen_taking_other_inputs_gets_its_own_copies_while_trials_live(monkeypatch):
    """Clover's attention decoders name q/k/v like a decoder layer's but read their keys from other states: once
    seen apart, the next call gives the group's layers their own copies, though trials still live (a prefill's row
    count pending) and would make copies only as the call can afford them; before, those layers computed without
    a copy (F.linear) for as long as the trials lived."""

    torch.manual_seed(0)
    model, x, states = CrossAttentionProjections(), torch.randn(2, 8), torch.randn(2, 8)
    ref = model(x, states)
    group = (model.q_proj, model.k_proj, model.v_proj)
    copies, trials, kind = copying_trials(model)
    trials.pending -= {n for n in range(PACK_ROWS + 1)}  # the verify forms settled on copies; a prefill's pending
    trials.forms.update({n: kind for n in (1, 2, 4, 8, 16)})
    copies.prepare_units(trials.units, kind)
    trials.next_call()
    with linear_forms([model], trials.forms, copies, trials):
        assert copies.get_fused(group, kind) is not None
        assert torch.allclose(model(x, states), ref, atol=1e-2)
    assert model.q_proj in copies.apart and trials.pending
    bound = []  # each layer's product as the block binds it: (form, from a copy)
    real = binding.form_product
    monkeypatch.setattr(binding, "form_product", lambda form, weight, bias, copy=None: bound.append(
        (form, copy is not None)) or real(form, weight, bias, copy))
    trials.next_call()
    with linear_forms([model], trials.forms, copies, trials):
        assert copies.get_fused(group, kind) is None and not copies.stacked
        assert all(copies.get(m, kind) is not None for m in group)
        assert torch.allclose(model(x, states), ref, atol=1e-2)
    assert trials.pending and bound == [(kind, True)] * 3


def test_layers_no_call_ran_get_their_copies_once_the_trials_are_ready(monkeypatch):
    """A process's first call of one-token steps (`budget="one-token"`, as the benchmark and the demo run first) runs
    the base alone: its copies are made and the trials are ready. The heads' layers, which no call ran, get theirs as
    the next call's `linear_forms` begins, as they do without trials. Before, they computed without copies for the
    life of the process, and the bf16 kernel's drafting with them, several times slower a draft."""
    from clover_hf.cpu.linears import PACKED, onednn_packs

    if not onednn_packs():
        pytest.skip("this torch build has no oneDNN: no blocked copies")
    model = tiny_model("llama")
    heads = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))  # run by no call yet
    monkeypatch.setattr(form_trials, "RESERVE_STEPS", -1e9)  # ahead enough to make copies from the start
    trials = FormTrials([model, heads], WeightCopies(limit=10**9), known={n: PACKED for n in form_trials.ROW_COUNTS},
                        pending=set(), plain_row_s=0.05)
    trials.next_call()
    with linear_forms([model, heads], trials.forms, trials.copies, trials):
        forward_rows(model, 1)
    assert trials.ready() and trials.copies.get(heads[0], PACKED) is None
    trials.next_call()
    with linear_forms([model, heads], trials.forms, trials.copies, trials):
        assert all(trials.copies.get(m, PACKED) is not None for m in heads)
        x = torch.randn(3, 64)
        torch.testing.assert_close(heads(x), torch.nn.functional.linear(
            torch.nn.functional.linear(x, heads[0].weight, heads[0].bias), heads[1].weight, heads[1].bias))


def test_a_row_count_settling_between_a_groups_layers_leaves_the_group_stacked():
    """A row count settles inside the product that completes its timings, which may be a decoder layer's q: its k
    and v then compute in the settled form, from the group's stacked copy, though q's product ran in a trial form.
    They compute on their own for that forward (exact), and the group is not taken for one whose members read other
    inputs: that had split SmolLM2's q/k/v and gate/up groups at random in a process's first calls, and kept every
    later verify forward of the process out of the decoder layers' one kernel call."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    group = (attn.q_proj, attn.k_proj, attn.v_proj)
    copies, trials, kind = copying_trials(model)
    copies.prepare_units(trials.units, kind)
    trials.next_call()
    x = torch.randn(1, 2, model.config.hidden_size)
    with torch.no_grad(), linear_forms([model], trials.forms, copies, trials):
        q = attn.q_proj(x)  # two rows pending: a trial form's product
        trials.pending.discard(2)  # ... that settles them, as the product completing their timings does
        trials.learnt.add(2)
        trials.forms[2] = kind
        k, v = attn.k_proj(x), attn.v_proj(x)
    assert not copies.apart
    for m, out in zip(group, (q, k, v)):
        assert torch.allclose(out, torch.nn.functional.linear(x, m.weight, m.bias), atol=1e-5)
    trials.next_call()
    with torch.no_grad(), linear_forms([model], trials.forms, copies, trials):  # settled: one stacked product
        assert copies.get_fused(group, kind) is not None
        again = [m(x) for m in group]
    assert not copies.apart
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(again, (q, k, v)))
