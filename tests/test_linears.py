"""Linear layers in the form measured faster for a verify step's few rows: same numbers, exact output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clover_hf import CloverForCausalLM, CostModel
from clover_hf.linears import MAX_ROWS, PAD_ROWS, faster_transposed, transposed_linear, transposed_linears

from .tiny import ARCHS, prompt, same, tiny_model

EVERY = list(range(2, MAX_ROWS + 1))


@pytest.mark.parametrize("rows", [1, 3, 8, 11, 16, 31])
def test_transposed_linear_computes_f_linear(rows):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 16), torch.randn(48), torch.randn(1, rows, 16)  # past 8 rows: padded
    out = transposed_linear(x, weight, bias)
    assert out.shape == (1, rows, 48) and torch.allclose(out, F.linear(x, weight, bias), atol=1e-5)


def test_transposed_linears_apply_to_listed_row_counts_and_are_undone():
    model = tiny_model("llama")
    own = model.lm_head.forward = lambda x: F.linear(x, model.lm_head.weight)  # as accelerate's hooks set one
    ids = prompt(3)
    ref = model(ids).logits
    calls = []
    original = torch.mm

    def spy(*args):
        calls.append(args[1].shape)
        return original(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "mm", spy)
        with transposed_linears([model], [ids.shape[1]]):
            inside = model(ids).logits
            one = model(ids[:, :1]).logits  # a row count not listed: F.linear
    assert torch.allclose(inside, ref, atol=1e-5) and torch.allclose(one, ref[:, :1], atol=1e-5)
    layers = sum(type(m) is torch.nn.Linear for m in model.modules()) - 1  # all but the lm_head with its own forward
    padded = ids.shape[1] + (-ids.shape[1]) % PAD_ROWS  # past PAD_ROWS rows, zero rows up to a multiple of it
    assert len(calls) == layers and all(shape[1] == padded for shape in calls)  # x.T: (hidden, rows)
    assert model.lm_head.forward is own
    assert all("forward" not in m.__dict__ for m in model.modules() if m is not model.lm_head)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_stays_exact_with_transposed_linears(arch, monkeypatch):
    import clover_hf.linears as linears

    used = []
    monkeypatch.setattr(linears, "transposed_linear", lambda x, *args: used.append(x.shape) or transposed_linear(x, *args))
    base = tiny_model(arch)
    ids = prompt(4)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    costs = CostModel.from_function(lambda rows, width: 10.0, draft_ms=0.0)  # the whole tree every step
    costs.transposed = EVERY
    assert same(clover.generate(ids, max_new_tokens=30, do_sample=False, budget=costs), ref)
    assert clover.generation_stats.verified_per_step > 2 and len(used) > 0  # verified in the transposed form


def test_forms_are_measured_on_the_cpu_within_their_bounds():
    model = tiny_model("llama")
    rows = faster_transposed([model], reps=1)
    assert set(rows) <= set(EVERY)
    assert faster_transposed([torch.nn.Sequential()]) == []  # no linear layers: nothing to measure


def test_transposed_linears_are_undone_on_error_and_take_a_layer_listed_twice_once():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="stop"):
        with transposed_linears([model, model], [2]):
            assert "forward" in model.lm_head.__dict__
            raise RuntimeError("stop")
    assert all("forward" not in m.__dict__ for m in model.modules())
