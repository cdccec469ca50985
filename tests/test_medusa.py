"""The Medusa-1 baseline heads: exact like Clover's, drafted as Medusa drafts, saved, trained and benchmarked."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from clover_hf import CloverConfig, CloverForCausalLM
from clover_hf.heads.medusa import MedusaHeads
from clover_hf.heads.tree import build_tree
from clover_hf.tools.bench import run_benchmark
from clover_hf.tools.cli import main as cli_main
from clover_hf.training.features import Example, FeatureSet, cache_features
from clover_hf.training.trainer import TrainConfig, Trainer

from .test_training import _args, _chats
from .tiny import (
    ARCHS,
    CHAT_TEMPLATE,
    byte_tokenizer,
    check_stats,
    left_padded,
    prompt,
    random_heads,
    same,
    save_tiny_base,
    tiny_model,
)


def medusa_model(base, seed: int = 0, **config) -> CloverForCausalLM:
    """Medusa heads with random weights (fresh ones are the identity and would all draft the same token)."""
    return random_heads(base, seed, head_type="medusa", **config)[0]


@pytest.mark.parametrize("lookup", [0, 6])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_medusa_heads_match_base(arch, lookup):
    base = tiny_model(arch)
    medusa = medusa_model(base)
    assert isinstance(medusa.clover_heads, MedusaHeads)
    for seed in (1, 2):
        ids = prompt(seed)
        ref = base.generate(ids, max_new_tokens=40, do_sample=False)
        out = medusa.generate(ids, max_new_tokens=40, do_sample=False, lookup=lookup)
        assert same(out, ref)
        check_stats(medusa.generation_stats, new_tokens=40)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_medusa_padded_batch_and_top_k_1_sampling_match_base(arch):
    base = tiny_model(arch)
    medusa = medusa_model(base, seed=3)
    ids, mask, _ = left_padded(prompt(1, 7), prompt(2, 12))
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    assert same(medusa.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0), ref)
    single = prompt(4)
    torch.manual_seed(0)
    sampled = medusa.generate(single, max_new_tokens=30, do_sample=True, top_k=1)  # top-1 sampling is greedy
    assert same(sampled, base.generate(single, max_new_tokens=30, do_sample=False))


def test_medusa_draft_takes_each_depths_top_k_whatever_the_parent():
    base = tiny_model("llama")
    medusa = medusa_model(base, draft_vocab_size=40)
    heads = medusa.clover_heads
    with torch.no_grad():
        heads.draft_token_ids.copy_(torch.arange(40) * 2)  # every other token: drafts map back to base ids
    paths = [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [1, 1, 0]]
    tree = build_tree(paths)
    feature = torch.randn(base.config.hidden_size)
    embed = base.get_input_embeddings()
    lm_head = heads.draft_lm_head(base.get_output_embeddings())
    drafted, probs = heads.draft(feature, torch.tensor(5), tree, embed, lm_head)
    by_path = dict(zip(tree.paths, zip(drafted.tolist(), probs.tolist())))
    tops = [lm_head(head(feature)).float().softmax(-1).topk(2) for head in heads.heads[:3]]
    ranked = [heads.draft_token_ids[top.indices].tolist() for top in tops]  # each head's top-2, as base ids
    for path, (token, prob) in by_path.items():
        assert token == ranked[len(path) - 1][path[-1]], path  # the rank-th token of head depth-1
        assert prob == pytest.approx(tops[len(path) - 1].values[path[-1]].item())  # and its probability
    assert by_path[(0, 0)] == by_path[(1, 0)] and by_path[(0, 0, 0)] == by_path[(1, 1, 0)]
    # Medusa's heads never see the root: another root drafts the same tree
    assert torch.equal(drafted, heads.draft(feature, torch.tensor(9), tree, embed, lm_head)[0])


def test_medusa_heads_learn_the_tokens_they_draft(tmp_path):
    """Heads fitted to one continuation draft it back: training's targets and drafting's depths line up.

    Measured: 1.55 tokens per step; with head i trained one position late (an off-by-one), 1.02.
    """
    base = tiny_model("llama").eval().requires_grad_(False)
    ids = prompt(3, 8)
    reference = base.generate(ids, max_new_tokens=48, do_sample=False)
    text = reference[0].tolist()
    cache_features(base, [Example(text, [0] * 8 + [1] * (len(text) - 8))], tmp_path / "f", top_k=4)
    torch.manual_seed(0)
    medusa = CloverForCausalLM.from_base(base, head_type="medusa", num_heads=3, tree=[[0], [0, 0], [0, 0, 0]])
    config = TrainConfig(output_dir=str(tmp_path / "o"), head_type="medusa", max_steps=200, batch_size=1, lr=3e-2,
                         warmup_steps=5, feature_loss_weight=0.0, eval_fraction=0, eval_every=0, save_every=1000)
    Trainer(config, medusa.clover_heads, base, FeatureSet.load(tmp_path / "f")).train(log=lambda *_: None)
    out = medusa.generate(ids, max_new_tokens=48, do_sample=False, lookup=0, budget="full")  # not the clock's choice
    assert same(out, reference)
    assert medusa.generation_stats.tokens_per_step > 1.3


def test_medusa_heads_save_load_and_card(tmp_path):
    base = tiny_model("qwen3")
    medusa = medusa_model(base, tree=[[0], [1], [0, 0]])
    medusa.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["head_type"] == "medusa" and config["model_type"] == "clover"
    card = (tmp_path / "m" / "README.md").read_text()
    assert "# Medusa draft heads" in card and "residual block" in card and "Augmenting Block" not in card
    CloverForCausalLM.from_base(base).save_pretrained(tmp_path / "c")  # Clover's config stays readable by
    assert "head_type" not in json.loads((tmp_path / "c" / "config.json").read_text())  # releases before head_type
    loaded = CloverForCausalLM.from_pretrained(tmp_path / "m", base_model=base)
    assert isinstance(loaded.clover_heads, MedusaHeads)
    ids = prompt(5)
    assert same(loaded.generate(ids, max_new_tokens=24, do_sample=False),
                medusa.generate(ids, max_new_tokens=24, do_sample=False))


def test_medusa_heads_refuse_dynamic_trees_and_unknown_types():
    with pytest.raises(ValueError, match="static trees only"):
        CloverConfig(hidden_size=64, vocab_size=100, head_type="medusa", dynamic_tree={"depth": 2, "width": 2, "nodes": 4})
    with pytest.raises(ValueError, match="head_type must be one of"):
        CloverConfig(hidden_size=64, vocab_size=100, head_type="eagle")
    medusa = medusa_model(tiny_model("llama"))
    with pytest.raises(ValueError, match="static trees only"):
        medusa.generate(prompt(1), max_new_tokens=8, do_sample=False, tree={"depth": 2, "width": 2, "nodes": 4})


def test_cli_trains_medusa_heads(tmp_path, cli_error):
    base_dir = save_tiny_base(tmp_path / "base")
    data = _chats(tmp_path / "chats.jsonl")
    out = tmp_path / "run"
    assert cli_main(_args(base_dir, data, out, **{"head-type": "medusa", "tree-size": "5"})) == 0
    medusa = CloverForCausalLM.from_pretrained(out / "heads")
    assert isinstance(medusa.clover_heads, MedusaHeads) and len(medusa.clover_config.tree) == 5
    assert any(h[0].linear.weight.abs().sum() > 0 for h in medusa.clover_heads.heads)  # trained away from the identity
    ids = prompt(3)
    assert same(medusa.generate(ids, max_new_tokens=20, do_sample=False),
                medusa.base_model.generate(ids, max_new_tokens=20, do_sample=False))
    # Clover heads cannot warm-start a Medusa run (or the other way round)
    clover_run = tmp_path / "clover"
    assert cli_main(_args(base_dir, data, clover_run)) == 0
    assert re.search("head_type=clover.*--head-type", cli_error(_args(base_dir, data, tmp_path / "again", **{"head-type": "medusa",
                                                              "init-heads": str(clover_run / "heads")})))
    assert re.search("head_type must be one of", cli_error(_args(base_dir, data, tmp_path / "bad", **{"head-type": "hydra"})))


def test_benchmark_runs_the_medusa_baseline(tmp_path):
    base = tiny_model("llama")
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    clover = CloverForCausalLM.from_base(base)
    results = run_benchmark(clover, tok, ["hello", "another prompt"], max_new_tokens=12,
                            baselines={"medusa": medusa_model(base)}, log=lambda *_: None)
    assert list(results) == ["plain generate", "clover, one-token steps", "clover", "medusa", "prompt lookup (10)"]
    medusa = results["medusa"]
    assert medusa.identical == 2 and medusa.new_tokens == 24
    assert len(medusa.accepted_lengths) == medusa.verify_steps == medusa.steps - 2 > 0  # two prompts, two prefills
    assert "verify forward" in medusa.stage_seconds


def test_bench_command_takes_medusa_heads(tmp_path, cli_error):
    base_dir = save_tiny_base(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    CloverForCausalLM.from_base(base).save_pretrained(tmp_path / "heads")
    medusa_model(base).save_pretrained(tmp_path / "medusa")
    (tmp_path / "p.txt").write_text("first prompt\nsecond prompt\n")
    common = ["bench", "--heads", str(tmp_path / "heads"), "--base-model", base_dir, "--dtype", "float32",
              "--prompts", str(tmp_path / "p.txt"), "--max-new-tokens", "8", "--no-prompt-lookup"]
    cli_main([*common, "--medusa-heads", str(tmp_path / "medusa"), "--out-dir", str(tmp_path / "out")])
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(results) == ["plain generate", "clover, one-token steps", "clover", "medusa"] and results["medusa"]["identical"] == 2
    assert "| medusa |" in (tmp_path / "out" / "results.md").read_text()
    assert re.search("not Medusa's", cli_error([*common, "--medusa-heads", str(tmp_path / "heads"), "--out-dir", str(tmp_path / "out2")]))
