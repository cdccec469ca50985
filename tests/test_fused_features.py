"""Heads that read several of the base's decoder layers (`feature_layers`, EAGLE-3's fused features): the base's own
output on every decode path, what decoding hands the heads equal to what training reads, a fresh fusion that starts
as the last hidden state alone, and configs that say what they read."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from clover_hf import CloverConfig, CloverForCausalLM, CloverHeads
from clover_hf.base.forward import base_forward
from clover_hf.training.features import base_targets

from .test_static_cache import COMPILE
from .test_bf16_kernel import BUILDS, built  # noqa: F401 (a fixture)
from .tiny import left_padded, oracle_model, prompt, same, tiny_model

TAPS = [0, -2]  # of three layers: the first and the second, besides the last hidden state


def three_layers(arch: str, **kwargs) -> torch.nn.Module:
    extra = {"n_layer": 3} if arch == "gpt2" else {"num_hidden_layers": 3}
    if arch == "gemma3_text":
        extra["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    return tiny_model(arch, **extra, **kwargs)


def fused_heads(base, seed: int = 0, **kwargs) -> CloverForCausalLM:
    """Heads reading TAPS whose fusion mixes every layer (fresh ones read the last hidden state alone)."""
    clover = CloverForCausalLM.from_base(base, feature_layers=TAPS, **kwargs)
    torch.manual_seed(seed)
    with torch.no_grad():
        clover.clover_heads.fuse.weight.normal_(0, 0.05)
    return clover


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma3_text", "gpt2"])
def test_fused_heads_decode_as_the_base_does(arch):
    base = three_layers(arch)
    clover = fused_heads(base)
    for seed in (1, 2):
        ids = prompt(seed, 12)
        ref = base.generate(ids, max_new_tokens=30, do_sample=False)
        for budget in ("full", "auto"):
            assert same(clover.generate(ids, max_new_tokens=30, do_sample=False, budget=budget), ref)
    oracle = oracle_model(base, ref, feature_layers=TAPS)
    assert same(oracle.generate(ids, max_new_tokens=30, do_sample=False), ref)
    assert max(oracle.generation_stats.accepted_lengths) >= 3  # long paths: the taps of accepted nodes kept


@pytest.mark.parametrize("compile", list(COMPILE))
def test_fused_heads_on_a_static_cache(compile):
    base = three_layers("llama")
    ids = prompt(3, 9)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    oracle = oracle_model(base, ref, feature_layers=TAPS)
    out = oracle.generate(ids, max_new_tokens=30, do_sample=False, cache_implementation="static", **COMPILE[compile])
    assert same(out, ref)
    assert oracle.generation_stats.verified_per_step > 1


def test_fused_heads_in_a_left_padded_batch():
    base = three_layers("qwen2")
    ids, mask, _ = left_padded(prompt(1, 7), prompt(2, 12))
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    out = fused_heads(base).generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, budget="full")
    assert same(out, ref)


def test_fused_heads_sample_with_top_k_1_as_greedy():
    base = three_layers("llama")
    ids = prompt(4, 10)
    ref = base.generate(ids, max_new_tokens=24, do_sample=False)
    out = fused_heads(base).generate(ids, max_new_tokens=24, do_sample=True, top_k=1, budget="full")
    assert same(out, ref)


def test_decoding_hands_the_heads_what_training_reads(monkeypatch):
    """The states decoding feeds the heads (prefill and accepted nodes) are the tapped layers' outputs, then the last
    hidden state, at each position: what `base_targets` gives training from one forward over the whole text."""
    base = three_layers("llama")
    clover = fused_heads(base)
    heads = clover.clover_heads
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    features = type(heads).features

    def spy(self, hidden, next_embeds, positions, cache=None, attn_mask=None):
        seen.append((hidden[0].clone(), positions[0].clone()))
        return features(self, hidden, next_embeds, positions, cache, attn_mask)

    monkeypatch.setattr(type(heads), "features", spy)
    ids = prompt(5, 11)
    out = clover.generate(ids, max_new_tokens=20, do_sample=False, budget="full")
    assert len(seen) > 2
    with torch.no_grad():
        inputs = base_targets(base, out, top_k=1, taps=tuple(TAPS))["inputs"][0]
        states = base(out, output_hidden_states=True).hidden_states
    width = base.config.hidden_size
    assert inputs.shape[-1] == 3 * width
    torch.testing.assert_close(inputs[:, :width], states[1][0])  # layer 0's output
    torch.testing.assert_close(inputs[:, width : 2 * width], states[2][0])  # layer 1's
    torch.testing.assert_close(inputs[:, 2 * width :], states[-1][0])  # the last hidden state, after the norm
    for hidden, positions in seen:
        torch.testing.assert_close(hidden, inputs[positions], rtol=1e-4, atol=1e-5)


def test_fresh_fused_heads_start_as_the_last_hidden_state_alone():
    base = three_layers("llama")
    plain = CloverForCausalLM.from_base(base).clover_heads
    fused = CloverHeads(CloverConfig.for_base(base.config, feature_layers=TAPS))
    missing = fused.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert missing == ["fuse.weight"]
    with torch.no_grad():
        _, last = base_forward(base, prompt(1), None, None, None)
        _, both = base_forward(base, prompt(1), None, None, None, taps=tuple(TAPS))
    embeds = base.get_input_embeddings()(prompt(2))
    positions = torch.arange(10)[None]
    assert torch.equal(fused.features(both, embeds, positions)[0], plain.features(last, embeds, positions)[0])


def test_feature_layers_in_the_config(tmp_path):
    base = three_layers("llama")
    clover = fused_heads(base)
    clover.save_pretrained(tmp_path / "heads")
    again = CloverForCausalLM.from_pretrained(base, clover_heads=tmp_path / "heads")
    assert again.clover_config.feature_layers == TAPS
    assert torch.equal(again.clover_heads.fuse.weight, clover.clover_heads.fuse.weight)
    ids = prompt(1)
    assert same(again.generate(ids, max_new_tokens=12, do_sample=False), base.generate(ids, max_new_tokens=12,
                                                                                     do_sample=False))
    plain = CloverConfig(hidden_size=64, vocab_size=256)
    assert "feature_layers" not in plain.to_dict()  # heads without taps save as before
    assert CloverHeads(plain).fuse is None
    for bad in ([], [1, 1], [1.5], "0"):
        with pytest.raises(ValueError, match="feature_layers"):
            CloverConfig(hidden_size=64, vocab_size=256, feature_layers=bad)
    with pytest.raises(ValueError, match="feature_layers"):
        CloverConfig(hidden_size=64, vocab_size=256, head_type="medusa", feature_layers=[0])
    with pytest.raises(ValueError, match="another base"):
        CloverForCausalLM.from_base(tiny_model("llama"), feature_layers=[0, 5])


def test_fused_heads_train_online_and_on_features_cached_with_their_taps(tmp_path):
    from clover_hf.training.features import Example, FeatureSet, cache_features
    from clover_hf.training.packing import PackedRows
    from clover_hf.training.trainer import TrainConfig, Trainer

    base = three_layers("llama").requires_grad_(False)
    clover = CloverForCausalLM.from_base(base, num_heads=2, draft_vocab_size=64, feature_layers=TAPS)
    rows = PackedRows.pack([Example(prompt(i, 12)[0].tolist(), [1] * 12) for i in range(6)], 24, 0)
    config = TrainConfig(output_dir=str(tmp_path / "o"), max_steps=6, batch_size=2, eval_fraction=0, save_every=100,
                         eval_every=0, warmup_steps=1, feature_layers=TAPS)
    trainer = Trainer(config, clover.clover_heads, base, rows, top_k=4)
    batch = trainer._device_batch([0, 1])
    assert batch["inputs"].shape[-1] == 3 * base.config.hidden_size
    torch.testing.assert_close(batch["inputs"][..., -base.config.hidden_size :], batch["hidden"])
    fuse_before = trainer.heads.fuse.weight.clone()
    first, _ = trainer._losses(batch)
    trainer.train(log=lambda *_: None)
    assert trainer._losses(batch)[0].item() < first.item()
    taps_part = trainer.heads.fuse.weight[:, : 2 * base.config.hidden_size]
    assert not torch.equal(trainer.heads.fuse.weight, fuse_before) and taps_part.abs().sum() > 0  # taps learnt
    example = Example(prompt(1, 12)[0].tolist(), [1] * 12)
    cache_features(base, [example], tmp_path / "f", top_k=4)  # the last states alone
    with pytest.raises(ValueError, match="cache them again.*--online"):
        Trainer(config, clover.clover_heads, base, FeatureSet.load(tmp_path / "f"))
    cache_features(base, [example], tmp_path / "t", top_k=4, taps=TAPS)
    cached = Trainer(config, clover.clover_heads, base, FeatureSet.load(tmp_path / "t"), top_k=4)
    online = Trainer(config, clover.clover_heads, base, PackedRows.pack([example], 12, 0), top_k=4)
    from_cache, from_base = cached._device_batch([0]), online._device_batch([0])
    assert from_cache["inputs"].shape == from_base["inputs"].shape == (1, 12, 3 * base.config.hidden_size)
    torch.testing.assert_close(from_cache["inputs"], from_base["inputs"], rtol=0.01, atol=0.01)  # stored in bf16
    plain_heads = CloverForCausalLM.from_base(base, num_heads=2, draft_vocab_size=64).clover_heads
    plain_config = dataclasses.replace(config, feature_layers=None)
    on_taps = Trainer(plain_config, plain_heads, base, FeatureSet.load(tmp_path / "t"), top_k=4)  # reads `hidden`
    assert "inputs" not in on_taps._device_batch([0])


@pytest.mark.parametrize("isa", BUILDS)
def test_taps_on_the_cpu_kernel_leave_the_verify_forward_as_it_was(isa, built, monkeypatch):
    """bf16, every product in the kernel's tiled form, the layers in kernel calls: with taps they run as one call per
    segment cut after each tapped layer, and the verify forward's logits and last hidden states stay bitwise those
    without taps; the taps are bitwise the layers' outputs run one call each, and the last layer's tap is the final
    norm's input."""
    from clover_hf.base import lean_layers, lean_stack
    from clover_hf.base.cache import new_cache
    from clover_hf.base.verify_forward import VerifyForward
    from clover_hf.cpu.binding import linear_forms
    from clover_hf.cpu.kernel_library import KERNEL
    from clover_hf.cpu.linears import TILED, WeightCopies

    monkeypatch.setattr(KERNEL, "lib", built(isa))
    model = tiny_model("llama", dtype=torch.bfloat16, head_dim=32, num_hidden_layers=4)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(1, 1, 3, 9, dtype=torch.bfloat16).masked_fill(
        torch.ones(3, 9, dtype=torch.bool).triu(7), torch.finfo(torch.bfloat16).min)
    segmented = []
    calls = lean_stack._Segments.__call__
    monkeypatch.setattr(lean_stack._Segments, "__call__", lambda self, *a: segmented.append(1) or calls(self, *a))

    def verify(taps: tuple[int, ...], pre_norm: bool = False):
        with torch.no_grad(), lean_layers.lean_layers(model, pack=True, taps=taps), linear_forms(
                [model], {1 << k: TILED for k in range(5)}, WeightCopies(limit=10**9)):
            cache = new_cache()
            model(ids[:, :6], cache=cache, use_cache=True)
            return VerifyForward(model, pre_norm, taps=taps)(ids[:, 6:9], mask, torch.arange(6, 9)[None], cache)

    plain, pre = verify(()), verify((), pre_norm=True)
    fused = verify((0, 2, -1))
    assert segmented  # the layers ran in segments
    width = model.config.hidden_size
    assert fused.hidden.shape == (1, 3, 4 * width)
    assert torch.equal(fused.logits, plain.logits) and torch.equal(fused.hidden[..., 3 * width :], plain.hidden)
    assert torch.equal(fused.hidden[..., 2 * width : 3 * width], pre.hidden)
    monkeypatch.setattr(lean_stack._Stack, "ready", lambda self, layers: None)  # each layer in a call of its own
    one_by_one = verify((0, 2, -1))
    assert torch.equal(one_by_one.hidden, fused.hidden) and torch.equal(one_by_one.logits, fused.logits)
    with torch.no_grad():
        own = model(ids, output_hidden_states=True).hidden_states[1][:, 6:9]  # layer 0's output, F.linear's products
    torch.testing.assert_close(fused.hidden[..., :width], own, rtol=0.05, atol=0.05)


def test_fused_heads_take_nothing_from_the_base_on_the_cpu_kernel():
    """bf16 on the CPU backend, one-token steps: heads reading taps leave the base's forwards as they are, so the
    output is bitwise that of heads reading the last hidden state alone."""
    base = three_layers("llama", dtype=torch.bfloat16, head_dim=32)
    ids = prompt(6, 12)
    plain = CloverForCausalLM.from_base(base).generate(ids, max_new_tokens=24, do_sample=False, budget="one-token")
    fused = fused_heads(base).to(torch.bfloat16)
    assert same(fused.generate(ids, max_new_tokens=24, do_sample=False, budget="one-token"), plain)


@pytest.mark.parametrize("arch,listed", [("llama", True), ("gpt2", True), ("gemma3_text", True), ("phi3", False)])
def test_each_family_is_read_through_its_architecture_entry(arch, listed):
    """Where a base keeps its decoder layers and final norm comes from its family's one entry (`ARCHITECTURES`);
    a family not listed is read by the names most use (`GENERIC`)."""
    from clover_hf.base.architectures import GENERIC, architecture
    from clover_hf.base.parts import decoder_layers, final_norm, rms_final_norm

    base = three_layers(arch) if arch != "phi3" else tiny_model(arch)
    family = architecture(base.config)
    assert (family is not GENERIC) == listed
    layers = decoder_layers(base)
    assert layers is not None and len(layers) == base.config.num_hidden_layers
    assert final_norm(base) is not None
    assert (rms_final_norm(base) is None) == (arch in ("gpt2", "gemma3_text"))  # LayerNorm; RMSNorm by (1 + w)


def test_fused_heads_warm_start_from_heads_that_read_the_last_state_alone(tmp_path):
    """`--init-heads` from heads without taps: every weight carries over and the fusion starts as the last hidden
    state alone, so the new heads draft as the old ones do."""
    from clover_hf.training.pipeline import warm_start

    base = three_layers("llama")
    plain = CloverForCausalLM.from_base(base)
    plain.save_pretrained(tmp_path / "plain")
    fused = CloverHeads(CloverConfig.for_base(base.config, feature_layers=TAPS))
    warm_start(fused, str(tmp_path / "plain"))
    ids = prompt(2)
    with torch.no_grad():
        _, last = base_forward(base, ids, None, None, None)
        _, both = base_forward(base, ids, None, None, None, taps=tuple(TAPS))
    embeds = base.get_input_embeddings()(prompt(3))
    positions = torch.arange(10)[None]
    assert torch.equal(fused.features(both, embeds, positions)[0],
                       plain.clover_heads.features(last, embeds, positions)[0])
    CloverForCausalLM(base, fused).save_pretrained(tmp_path / "fused")
    with pytest.raises(ValueError, match="feature_layers"):  # the other way: taps the new heads would not read
        warm_start(CloverHeads(CloverConfig.for_base(base.config)), str(tmp_path / "fused"))
