"""Decoder layers run lean: bitwise the layers' own output, and their own forward wherever that is not sure."""

from __future__ import annotations

import contextlib

import pytest
import torch

import clover_hf.backends.torch_backend as torch_backend
import clover_hf.base.lean_layers as lean_module
import clover_hf.base.lean_model as lean_model
from clover_hf.base.cache import new_cache
from clover_hf.base.lean_layers import lean_layers, lean_reason
from clover_hf.base.parts import decoder_layers

from .tiny import oracle_model, prompt, same, tiny_model

LEAN = ["llama", "mistral", "qwen2", "qwen3"]


def _forwards(model, lean: bool) -> list[torch.Tensor]:
    """Logits of a padded two-row prefill, a 5-token step under a tree mask, and a one-token step, then the
    cache's keys and values: what a decode computes."""
    torch.manual_seed(3)
    ids = torch.randint(0, 256, (2, 30))
    pad = torch.ones(2, 30, dtype=torch.long)
    pad[1, :4] = 0
    cache = new_cache()
    blocked = torch.finfo(model.dtype).min
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]).bool()
    step_mask = torch.zeros(2, 1, 5, 35, dtype=model.dtype)
    step_mask[..., 30:].masked_fill_(~tree, blocked)
    step_mask[1, ..., :4] = blocked
    one_mask = torch.zeros(2, 1, 1, 36, dtype=model.dtype)
    one_mask[1, ..., :4] = blocked
    ctx = lean_layers(model) if lean else contextlib.nullcontext(0)
    with torch.no_grad(), ctx as count:
        assert count == (len(decoder_layers(model)) if lean else 0)
        outs = [model(input_ids=ids, attention_mask=pad, cache=cache, use_cache=True).logits]
        positions = torch.arange(30, 35)[None].expand(2, -1)
        outs.append(model(input_ids=ids[:, :5], attention_mask=step_mask, position_ids=positions, cache=cache,
                          use_cache=True).logits)
        outs.append(model(input_ids=ids[:, 5:6], attention_mask=one_mask, position_ids=torch.full((2, 1), 35),
                          cache=cache, use_cache=True).logits)
    layer = cache.layers[0]
    return outs + [layer.keys, layer.values]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", LEAN)
def test_lean_layers_compute_the_layers_own_output_bitwise(arch, dtype):
    model = tiny_model(arch, dtype=dtype)
    for own, lean in zip(_forwards(model, False), _forwards(model, True)):
        assert own.shape == lean.shape and torch.equal(own, lean)
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))  # given back after the block


def test_lean_layers_call_the_attention_the_config_names():
    model = tiny_model("qwen2")
    model.config._attn_implementation = "eager"
    for own, lean in zip(_forwards(model, False), _forwards(model, True)):
        assert torch.equal(own, lean)


@pytest.mark.parametrize("arch", ["phi3", "gemma3_text", "gpt2"])
def test_other_layers_keep_their_own_forward(arch):
    model = tiny_model(arch)
    assert "is not a decoder layer of" in lean_reason(decoder_layers(model)[0])
    with lean_layers(model) as count:
        assert count == 0


def test_layers_with_hooks_or_in_training_keep_their_own_forward():
    model = tiny_model("llama")
    layers = decoder_layers(model)
    seen = []
    handle = layers[1].mlp.register_forward_hook(lambda module, args, out: seen.append(out))
    assert "hooks" in lean_reason(layers[1])
    with torch.no_grad(), lean_layers(model) as count:
        assert count == 1 and "forward" in layers[0].__dict__ and "forward" not in layers[1].__dict__
        model(prompt(length=6))
    assert len(seen) == 1  # the hooked layer ran its own forward, hook included
    handle.remove()
    handle = layers[0].self_attn.q_proj.register_forward_pre_hook(lambda module, args: seen.append(args))
    assert "hooks" in lean_reason(layers[0])
    with torch.no_grad(), lean_layers(model) as count:
        assert count == 1 and "forward" not in layers[0].__dict__
        model(prompt(length=6))
    assert len(seen) == 2
    handle.remove()
    model.train()
    assert lean_reason(layers[0]) == "the model is in training mode"
    with lean_layers(model) as count:
        assert count == 0


def test_a_lean_forward_that_does_not_match_is_not_used(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(lean_module.VERDICTS, "layers", {})
    real = lean_module.lean_forward
    monkeypatch.setattr(lean_module, "lean_forward",
                        lambda layer, pack, masks: (lambda *a, **k: real(layer, pack, masks)(*a, **k) * 2))
    ids = prompt(length=8)
    with torch.no_grad():
        own = model(ids).logits
        with pytest.warns(UserWarning, match="does not match"), lean_layers(model) as count:
            assert count == 0
            assert torch.equal(model(ids).logits, own)


def test_decoding_runs_the_layers_lean_and_matches_the_base(monkeypatch):
    base = tiny_model("qwen2")
    ids = prompt(length=12)
    reference = base.generate(ids, max_new_tokens=40, do_sample=False)
    counts = []

    @contextlib.contextmanager
    def counted(model, pack, taps=()):
        with lean_layers(model, pack, taps) as count:
            counts.append(count)
            yield count

    monkeypatch.setattr(torch_backend, "lean_layers", counted)
    model = oracle_model(base, reference)
    out = model.generate(ids, max_new_tokens=40, do_sample=False)
    assert same(out, reference) and model.generation_stats.tokens_per_step > 2
    assert counts == [len(decoder_layers(base))]


def test_one_half_precision_token_attends_packed_as_closely_as_rounding_allows():
    """On the CPU in bf16, one query token attends with its heads packed as rows of their key/value head
    (faster there than SDPA's own GQA): the same attention, to rounding."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(5))
    outs = []
    for lean in (False, True):
        cache = new_cache()
        ctx = lean_layers(model, pack=True) if lean else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            model(input_ids=ids[:, :-1], cache=cache, use_cache=True)
            outs.append(model(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits.float())
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=0.01 * outs[0].abs().max().item())


@pytest.mark.parametrize("tokens", [3, lean_module.PACK_QUERIES])
def test_a_few_half_precision_tokens_attend_packed_under_their_tree_mask(tokens, monkeypatch):
    """A verify forward's few query tokens in bf16 over a long text attend with their heads packed, each packed row
    under its own token's row of the tree mask: the same attention as SDPA's own, to rounding; more tokens (a
    prefill), and a few over a short text, attend unpacked."""
    monkeypatch.setattr(lean_module, "PACK_KEYS", 300)
    model = tiny_model("llama", dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (2, 300 + tokens), generator=torch.Generator().manual_seed(6))
    tree = torch.eye(tokens, dtype=torch.bool)
    tree[:, 0] = tree[1::2, 1] = True  # a tree: every node sees the root, odd ones the first child too
    blocked = torch.finfo(torch.bfloat16).min
    mask = torch.zeros(2, 1, tokens, 300 + tokens, dtype=torch.bfloat16)
    mask[..., 300:].masked_fill_(~tree, blocked)
    mask[1, ..., :7] = blocked  # the second row's padding
    packed = []
    monkeypatch.setattr(lean_module, "_packed_attention", _counting(lean_module._packed_attention, packed))
    outs = []
    for lean in (False, True):
        cache = new_cache()
        ctx = lean_layers(model, pack=True) if lean else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            model(input_ids=ids[:, :300], cache=cache, use_cache=True)
            outs.append(model(input_ids=ids[:, 300:], attention_mask=mask, cache=cache, use_cache=True).logits.float())
    assert len(packed) == len(decoder_layers(model))
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=0.01 * outs[0].abs().max().item())
    with torch.no_grad(), lean_layers(model, pack=True):
        cache = new_cache()
        model(input_ids=ids[:, :280], cache=cache, use_cache=True)  # a prefill's many tokens: unpacked
        short = torch.zeros(2, 1, 3, 283, dtype=torch.bfloat16)  # a few tokens over fewer than PACK_KEYS: unpacked
        model(input_ids=ids[:, 280:283], attention_mask=short, cache=cache, use_cache=True)
    assert len(packed) == len(decoder_layers(model))


def _counting(fn, calls: list):
    def counted(*args, **kwargs):
        calls.append(args[0].shape[2])
        return fn(*args, **kwargs)
    return counted


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embeddings_from_a_table_are_bitwise_the_modules_own(model_type, dtype):
    """The lean forward's cos and sin, rows of a table of positions 0..P-1 (grown as positions pass it), equal the
    rotary module's own call bitwise for rows of consecutive and of tree positions; a rope type whose angles depend on
    the length (dynamic), and positions past the most a table holds, are left to the module."""
    rotary = tiny_model(model_type, dtype=dtype).get_decoder().rotary_emb
    x = torch.zeros(2, 1, 64, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for width in (1, 2, 3, 5, 8, 11, 16, 17):
            start = int(torch.randint(0, 700, (1,), generator=generator))
            for positions in (torch.arange(start, start + width).expand(2, -1),
                              start + torch.randint(0, 4, (2, width), generator=generator).sort(-1).values):
                got, want = lean_model.rotary_embeddings(rotary, x, positions), rotary(x, position_ids=positions)
                assert all(g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))
    assert lean_model.TABLES.rotary[rotary].cos.shape[0] >= 700  # grown past the first table's 256 positions
    far = torch.arange(lean_model.ROTARY_TABLE_MOST, lean_model.ROTARY_TABLE_MOST + 3)[None]
    with torch.inference_mode():  # past the most a table holds: the module's own call, the table left as it was
        got, want = lean_model.rotary_embeddings(rotary, x[:1], far), rotary(x[:1], position_ids=far)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert lean_model.TABLES.rotary[rotary].cos.shape[0] < lean_model.ROTARY_TABLE_MOST

    dynamic = tiny_model("llama", dtype=dtype, rope_scaling={"rope_type": "dynamic", "factor": 2.0}).get_decoder()
    called = []
    dynamic.rotary_emb.register_forward_hook(lambda *args: called.append(1))
    with torch.inference_mode():
        lean_model.rotary_embeddings(dynamic.rotary_emb, x, torch.arange(3)[None])
    assert called == [1] and dynamic.rotary_emb not in lean_model.TABLES.rotary
