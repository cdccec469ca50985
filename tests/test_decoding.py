"""Greedy Clover output equals the base model's own `generate`, token for token, in fp32."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from clover_hf import CloverForCausalLM
from clover_hf.base.cache import OUTPUT_CACHE_FIELD
from clover_hf.decode import rows
from clover_hf.decode.loop import clover_generate
from clover_hf.decode.rows import Emitter

from .tiny import ARCHS, byte_tokenizer, check_stats, oracle_model, prompt, same, tiny_model

ALL = list(ARCHS)



DRAFTING = {  # every way of drafting: the static tree, a lookup chain, a dynamic tree, both
    "static": {},
    "lookup": {"lookup": 8},
    "lookup grows": {"lookup": 2, "lookup_max": 12},
    "dynamic": {"tree": {"depth": 3, "width": 3, "nodes": 10}},
    "dynamic+lookup": {"tree": {"depth": 3, "width": 3, "nodes": 10}, "lookup": 6},
}


@pytest.mark.parametrize("drafting", list(DRAFTING))
@pytest.mark.parametrize("arch", ALL)
def test_random_heads_match_base(arch, drafting):
    base = tiny_model(arch)
    clover = CloverForCausalLM.from_base(base)
    for seed in (1, 2):
        ids = prompt(seed)
        ref = base.generate(ids, max_new_tokens=40, do_sample=False)
        out = clover.generate(ids, max_new_tokens=40, do_sample=False, **DRAFTING[drafting])
        assert same(out, ref)
        check_stats(clover.generation_stats, new_tokens=40)


@pytest.mark.parametrize("arch", ALL)
def test_oracle_heads_accept_long_paths(arch):
    """Heads that draft the right tokens: long paths, other branches, compaction, bonus tokens."""
    base = tiny_model(arch)
    ids = prompt(3, length=6)  # prompt + 60 tokens exceeds the Mistral/Gemma3 sliding windows
    ref = base.generate(ids, max_new_tokens=60, do_sample=False)
    clover = oracle_model(base, ref)
    out = clover.generate(ids, max_new_tokens=60, do_sample=False)
    assert same(out, ref)
    stats = clover.generation_stats
    assert max(stats.accepted_lengths) == clover.clover_config.num_heads  # a full-depth path was accepted
    assert 0 in stats.accepted_lengths or 1 in stats.accepted_lengths  # and short ones too
    assert stats.tokens_per_step > 2.5


def test_sliding_window_mask_matters():
    """Without the window in the mask, Gemma3's sliding layers would see too much: the test would fail."""
    from clover_hf.base import forward as verification

    base = tiny_model("gemma3_text")
    ids = prompt(3, length=6)
    ref = base.generate(ids, max_new_tokens=40, do_sample=False)
    clover = oracle_model(base, ref)
    original = verification.MaskLayout.for_config
    try:
        verification.MaskLayout.for_config = classmethod(lambda cls, cfg: cls(mapping=False, sliding_window=None))
        broken = clover.generate(ids, max_new_tokens=40, do_sample=False)
    finally:
        verification.MaskLayout.for_config = original
    assert not same(broken, ref)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 8, 13])
def test_max_new_tokens_mid_path(arch, max_new_tokens):
    base = tiny_model(arch)
    ids = prompt(4)
    long_ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    clover = oracle_model(base, long_ref)
    out = clover.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    assert same(out, long_ref[:, : ids.shape[1] + max_new_tokens])
    assert clover.generation_stats.new_tokens == max_new_tokens


def test_max_length():
    base = tiny_model("llama")
    ids = prompt(5)
    ref = base.generate(ids, max_length=25, do_sample=False)
    out = oracle_model(base, base.generate(ids, max_new_tokens=40, do_sample=False)).generate(
        ids, max_length=25, do_sample=False
    )
    assert same(out, ref) and out.shape[1] == 25


@pytest.mark.parametrize("drafting", list(DRAFTING))
def test_generation_up_to_the_last_learned_position(drafting):
    # GPT-2 embeds 32 positions here: no tree or chain node may be placed past what the text can reach
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", **(ARCHS["gpt2"] | {"n_positions": 32}))
    base = AutoModelForCausalLM.from_config(config).eval()
    ids = prompt(5, length=24)
    ref = base.generate(ids, max_new_tokens=8, do_sample=False)
    assert ref.shape[1] == 32
    for clover in (CloverForCausalLM.from_base(base), oracle_model(base, ref)):
        assert same(clover.generate(ids, max_new_tokens=8, do_sample=False, **DRAFTING[drafting]), ref)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_eos_inside_accepted_path(arch):
    base = tiny_model(arch)
    ids = prompt(6)
    free = base.generate(ids, max_new_tokens=40, do_sample=False)
    generated = free[0, ids.shape[1] :].tolist()
    for k in (3, 6, 9):
        eos = generated[k]
        if eos in generated[:k]:
            continue
        for eos_arg in (eos, [VOCAB_UNUSED(generated), eos]):
            ref = base.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=eos_arg)
            clover = oracle_model(base, free)
            out = clover.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=eos_arg)
            assert same(out, ref)
            assert out[0, -1].item() == eos and out.shape[1] == ids.shape[1] + k + 1


class _StopAt(StoppingCriteria):
    """Stops once the text holds `length` tokens: a criterion of the caller's, which Clover calls token by token."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_callers_criterion_stops_inside_an_accepted_path(arch):
    base = tiny_model(arch)
    ids = prompt(4)
    free = base.generate(ids, max_new_tokens=30, do_sample=False)
    for k in (2, 5, 9):
        stop = StoppingCriteriaList([_StopAt(ids.shape[1] + k)])
        ref = base.generate(ids, max_new_tokens=30, do_sample=False, stopping_criteria=stop)
        clover = oracle_model(base, free)
        out = clover.generate(ids, max_new_tokens=30, do_sample=False, stopping_criteria=stop)
        assert same(out, ref) and out.shape[1] == ids.shape[1] + k
        assert max(clover.generation_stats.accepted_lengths) >= 2  # the oracle's paths run past the stop


class _Eos(EosTokenCriteria):  # the same criteria under other types: called token by token
    pass


class _MaxLength(MaxLengthCriteria):
    pass


class _Counted(StoppingCriteriaList):
    """The criteria, counting the emitter's calls."""

    calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return super().__call__(input_ids, scores, **kwargs)


def test_emitter_reads_eos_and_max_length_as_the_criteria_decide_them():
    torch.manual_seed(0)
    for trial in range(200):
        eos = torch.randint(0, 12, (int(torch.randint(1, 3, ())),)).tolist()
        max_length = int(torch.randint(4, 12, ()))
        limit = [None, 5, 9][trial % 3]
        start = torch.randint(0, 12, (1, int(torch.randint(1, 4, ()))))
        tokens = torch.randint(0, 12, (int(torch.randint(1, 6, ())),))
        scores = torch.zeros(tokens.shape[0], 12)
        results = []
        for criteria in ([MaxLengthCriteria(max_length, limit), EosTokenCriteria(eos)],
                         [_MaxLength(max_length, limit), _Eos(eos)]):
            counted = _Counted(criteria)
            emitter = Emitter(start.clone(), counted, None, [], None)
            n, finished = emitter.emit(tokens, scores, scores)
            results.append((n, finished, emitter.input_ids.tolist(), len(emitter.scores), counted.calls))
        (n, finished, ids, kept, calls), (*slow, slow_calls) = results
        assert (n, finished, ids, kept) == tuple(slow)
        assert slow_calls > 0
        # read here unless the text would pass the model's position limit (where max-length warns)
        assert calls == (0 if limit is None or start.shape[1] + tokens.shape[0] <= limit else slow_calls)


def VOCAB_UNUSED(tokens: list[int]) -> int:
    return next(t for t in range(1, 256) if t not in tokens)


def test_stop_strings():
    base = tiny_model("qwen2")
    tok = byte_tokenizer()
    ids = prompt(7)
    free = base.generate(ids, max_new_tokens=40, do_sample=False)
    new = free[0, ids.shape[1] :].tolist()
    k = next(i for i in range(5, len(new) - 1) if all(33 <= t <= 126 for t in new[i : i + 2]))
    stop = tok.decode(new[k : k + 2])
    ref = base.generate(ids, max_new_tokens=40, do_sample=False, stop_strings=[stop], tokenizer=tok)
    out = oracle_model(base, free).generate(ids, max_new_tokens=40, do_sample=False, stop_strings=[stop], tokenizer=tok)
    assert ref.shape[1] < free.shape[1]  # the stop string did stop generation early
    assert same(out, ref)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_text_streamer_prints_same_text(arch):
    base = tiny_model(arch)
    tok = byte_tokenizer()
    ids = prompt(8)
    free = base.generate(ids, max_new_tokens=30, do_sample=False)
    clover = oracle_model(base, free)
    printed = []
    for model in (base, clover):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            model.generate(ids, max_new_tokens=30, do_sample=False, streamer=TextStreamer(tok, skip_prompt=True))
        printed.append(buf.getvalue())
    assert printed[0] == printed[1]
    assert printed[0].strip()


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_text"])
@pytest.mark.parametrize(
    "processors",
    [dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2), dict(min_new_tokens=10, eos_token_id=7)],
    ids=["repetition_penalty", "no_repeat_ngram", "min_new_tokens"],
)
def test_logits_processors_use_each_nodes_prefix(arch, processors):
    base = tiny_model(arch)
    ids = prompt(9)
    ref = base.generate(ids, max_new_tokens=40, do_sample=False, **processors)
    for clover in (CloverForCausalLM.from_base(base), oracle_model(base, ref)):
        out = clover.generate(ids, max_new_tokens=40, do_sample=False, **processors)
        assert same(out, ref)


def test_return_dict_scores_and_logits():
    base = tiny_model("llama")
    ids = prompt(10)
    kw = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_scores=True,
              output_logits=True, repetition_penalty=1.3)
    ref = base.generate(ids, **kw)
    out = oracle_model(base, ref.sequences).generate(ids, **kw)
    assert same(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 20
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert getattr(out, OUTPUT_CACHE_FIELD).get_seq_length() == out.sequences.shape[1] - 1


def test_returned_tensors_are_normal_and_the_cache_continues_plain_decoding():
    """The loop runs under inference mode; what it returns must not be inference tensors."""
    base = tiny_model("llama")
    ids = prompt(10)
    kw = dict(do_sample=False, return_dict_in_generate=True, output_scores=True)
    out = oracle_model(base, base.generate(ids, max_new_tokens=30, do_sample=False)).generate(
        ids, max_new_tokens=20, **kw)
    assert not out.sequences.is_inference() and not any(s.is_inference() for s in out.scores)
    out.sequences[0, 0] = out.sequences[0, 0]  # in place, as callers do
    cache = {OUTPUT_CACHE_FIELD: getattr(out, OUTPUT_CACHE_FIELD)}  # `cache` from transformers 5.24, else past_key_values
    more = base.generate(out.sequences, **cache, max_new_tokens=10, do_sample=False)
    assert same(more, base.generate(ids, max_new_tokens=30, do_sample=False))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_forwards_hand_the_cache_by_the_keyword_the_model_takes(arch, tmp_path):
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` and warns that the old name goes:
    Clover's own forwards (prefill, verify, cost timing) must use whichever name the model takes."""
    import warnings

    from clover_hf import DraftBudget

    base = tiny_model(arch)
    ids = prompt(4)
    ref = base.generate(ids, max_new_tokens=12, do_sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = oracle_model(base, ref).generate(ids, max_new_tokens=12, do_sample=False,
                                               budget=DraftBudget(cache_dir=tmp_path))  # times its verify forwards
    assert same(out, ref)
    assert not [w for w in caught if "past_key_values" in str(w.message)]


def test_attention_mask_with_left_padding():
    base = tiny_model("llama")
    ids = prompt(11)
    ids[0, :3] = 0
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False)
    out = oracle_model(base, ref).generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False)
    assert same(out, ref)
    full = torch.ones_like(ids)
    assert same(
        CloverForCausalLM.from_base(base).generate(ids, attention_mask=full, max_new_tokens=25, do_sample=False),
        base.generate(ids, attention_mask=full, max_new_tokens=25, do_sample=False),
    )


@pytest.mark.parametrize("arch", ALL)
def test_prefill_of_one_unpadded_prompt_builds_no_prompt_by_prompt_mask(arch, monkeypatch):
    """A long prompt's (P, P) mask would take gigabytes: one unpadded row without sliding layers is
    prefilled through the base's own causal mask, as in plain `generate`, and stays exact."""
    import clover_hf.base.forward as verification

    widths = []
    build = verification.additive_mask
    def recording(past, new, allowed, *args, **kwargs):
        widths.append(new.shape[-1])
        return build(past, new, allowed, *args, **kwargs)

    monkeypatch.setattr(verification, "additive_mask", recording)
    tree_masks = []  # every step's mask
    attention = rows.Batch.attention
    monkeypatch.setattr(rows.Batch, "attention", lambda self, *args: tree_masks.append(attention(self, *args))
                        or tree_masks[-1])
    base = tiny_model(arch)
    ids = prompt(5, length=60)
    ref = base.generate(ids, max_new_tokens=20, do_sample=False)
    out = oracle_model(base, ref).generate(ids, max_new_tokens=20, do_sample=False, lookup=0)
    assert same(out, ref)
    sliding = verification.MaskLayout.for_config(base.config).sliding_window is not None
    assert (60 in widths) == sliding  # with sliding layers the explicit mask is kept
    one_token = [m for m in tree_masks if isinstance(m, torch.Tensor) and m.dim() == 2]  # the base's own mask path
    assert len(one_token) < len(tree_masks)  # the tree steps build theirs


@pytest.mark.parametrize("tree", [[[0]], [[0], [0, 0], [0, 0, 0]], [[0], [1], [2], [0, 0], [2, 0], [2, 0, 1]]])
def test_tree_as_generate_argument(tree):
    base = tiny_model("qwen3")
    ids = prompt(12)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    clover = oracle_model(base, ref)
    out = clover.generate(ids, max_new_tokens=30, do_sample=False, tree=tree)
    assert same(out, ref)
    assert max(clover.generation_stats.accepted_lengths) == max(len(p) for p in tree)


def test_generation_config_object_and_defaults():
    base = tiny_model("llama")
    base.generation_config.max_new_tokens = 12
    base.generation_config.do_sample = False
    ids = prompt(13)
    clover = CloverForCausalLM.from_base(base)
    assert same(clover.generate(ids), base.generate(ids))
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=7, do_sample=False, repetition_penalty=1.2)
    assert same(clover.generate(ids, generation_config=gc), base.generate(ids, generation_config=gc))


def test_fp64_is_exact_and_bf16_emits_the_greedy_token_to_rounding():
    """fp64 is exact too. In bf16 a many-token forward rounds differently from one-token decoding, so
    Clover and plain bf16 `generate` may part at near-ties (their agreement is a benchmark's rate); what
    holds is that every token Clover emits is the greedy choice of the same weights evaluated in float32,
    to bf16 rounding. Measured: exactly the float32 argmax at all 30 positions."""
    base = tiny_model("llama", dtype=torch.float64)
    ids = prompt(14)
    ref = base.generate(ids, max_new_tokens=20, do_sample=False)
    assert same(oracle_model(base, ref).generate(ids, max_new_tokens=20, do_sample=False), ref)

    bf16 = tiny_model("llama", dtype=torch.bfloat16)
    ids = prompt(15)
    out = CloverForCausalLM.from_base(bf16).generate(ids, max_new_tokens=30, do_sample=False, budget="full", lookup=6)
    assert out.shape == (1, ids.shape[1] + 30) and same(out[:, : ids.shape[1]], ids)
    fp32 = tiny_model("llama")
    fp32.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    with torch.no_grad():
        logits = fp32(out).logits[0, ids.shape[1] - 1 : -1]
    chosen = logits.gather(-1, out[0, ids.shape[1] :, None])[:, 0]
    gap = (logits.max(-1).values - chosen) / logits.std(-1)  # 0 where Clover took the float32 argmax
    assert gap.max() < 0.02, gap


def _backends() -> tuple[bool, bool, bool, bool]:
    cuda = torch.backends.cuda
    return cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()


def test_tree_attention_leaves_out_cudnn_on_cuda_only():
    """cuDNN attention plans per input shape, and tree forwards change shape every step: Clover's forwards
    on CUDA run with cuDNN attention off. The flags are global, so this runs without a GPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from clover_hf.decode.call import tree_attention_backends

    cuda = torch.device("cuda")
    every = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(every):
        with tree_attention_backends(torch.device("cpu")):
            assert _backends() == (True, True, True, True)
        with tree_attention_backends(cuda):
            assert _backends() == (False, True, True, True)
        assert _backends() == (True, True, True, True)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]):  # the caller's choice is narrowed, not widened
        with tree_attention_backends(cuda):
            assert _backends() == (False, False, False, True)
        assert _backends() == (True, False, False, True)
    for alone in ([SDPBackend.CUDNN_ATTENTION], [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        with sdpa_kernel(alone):  # nothing else could take the tree's mask: left as the caller set it
            before = _backends()
            with tree_attention_backends(cuda):
                assert _backends() == before


def test_profile_records_stage_times():
    base = tiny_model("llama")
    ids = prompt(15)
    clover = CloverForCausalLM.from_base(base)
    out = clover.generate(ids, max_new_tokens=10, do_sample=False, clover_profile=True)
    assert same(out, base.generate(ids, max_new_tokens=10, do_sample=False))
    stages = clover.generation_stats.stage_seconds
    assert {"draft", "verify forward", "accept", "emit + compact"} <= set(stages)
    assert all(v > 0 for v in stages.values())
    clover.generate(ids, max_new_tokens=10, do_sample=False)
    assert clover.generation_stats.stage_seconds == {}


def test_profiled_stages_are_the_steps_alone(monkeypatch):
    """The per-stage times describe decode steps: the prefill (made slow here) is not charged to drafting."""
    import time

    from clover_hf.decode import loop as decoding

    real = decoding.prefill

    def slow_prefill(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(decoding, "prefill", slow_prefill)
    clover = CloverForCausalLM.from_base(tiny_model("llama"))
    clover.generate(prompt(15), max_new_tokens=4, do_sample=False, clover_profile=True)
    assert sum(clover.generation_stats.stage_seconds.values()) < 0.3


class _Stop(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == 3


@pytest.mark.parametrize("call, words", [
    (lambda c, ids: c.generate(ids, max_new_tokens=5, lookup=-1), "lookup must be an int >= 0"),
    (lambda c, ids: c.generate(ids, max_new_tokens=5, lookup=2.5), "lookup must be an int >= 0"),
    (lambda c, ids: c.generate(ids, max_new_tokens=5, lookup_max=-3), "lookup_max must be an int >= 0"),
    (lambda c, ids: c.generate(ids, max_new_tokens=5, tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]),
     "the tree is 5 deep but the heads draft 4"),
    (lambda c, ids: c.generate(ids, max_new_tokens=5, tree={"depth": 6, "width": 2, "nodes": 4}),
     "the tree is 6 deep but the heads draft 4"),
    (lambda c, ids: c.generate(ids, max_new_tokens=5, tree=[[0, 0]]), "no parent"),
    (lambda c, ids: c.generate(ids, max_new_tokens=5, budget="fast"), "budget must be"),
    # a batch whose rows may stop at different lengths, with nothing to pad them with
    (lambda c, ids: c.base_model.generate(ids.repeat(2, 1), max_new_tokens=5, stopping_criteria=[_Stop()],
                                          custom_generate=clover_generate, clover_heads=c.clover_heads),
     "needs pad_token_id"),
])
def test_bad_arguments_fail_before_any_forward(call, words):
    base = tiny_model("llama")
    base.generation_config.pad_token_id = None
    clover = CloverForCausalLM.from_base(base)
    forwards = []
    base.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(ValueError, match=words):
        call(clover, prompt(16))
    assert forwards == []
