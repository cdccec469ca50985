"""The heads' options that follow Clover-2's and Medusa-1's public code: Clover-2's linear output heads,
the Augmenting Block's final norm started from the base's, Medusa-1's projection per head, and soft
labels cut to the base's top-k. Each decodes exactly, survives saving, and trains."""

from __future__ import annotations

import json

import pytest
import torch

from clover_hf import CloverConfig, CloverForCausalLM
from clover_hf.heads.clover import CloverHeads
from clover_hf.heads.decoder import LinearOutputHeads
from clover_hf.heads.medusa import MedusaHeads
from clover_hf.heads.tree import build_tree
from clover_hf.hub.card import render_model_card
from clover_hf.training.features import Example, FeatureSet, cache_features
from clover_hf.training.trainer import TrainConfig, Trainer, head_losses

from .tiny import prompt, random_heads, same, tiny_model


@pytest.mark.parametrize("bad, match", [
    (dict(output_head="mlp"), "output_head must be one of"),
    (dict(head_type="medusa", output_head="linear"), "form of Clover's heads"),
    (dict(own_lm_heads=True), "use it with head_type='medusa'"),
])
def test_config_refuses_options_that_do_not_fit(bad, match):
    with pytest.raises(ValueError, match=match):
        CloverConfig(hidden_size=64, vocab_size=256, **bad)


def test_configs_leave_default_options_out_so_older_releases_read_them():
    plain = CloverConfig(hidden_size=64, vocab_size=256).to_dict()
    assert "output_head" not in plain and "own_lm_heads" not in plain
    linear = CloverConfig(hidden_size=64, vocab_size=256, output_head="linear")
    assert CloverConfig.from_dict(linear.to_dict()) == linear
    medusa = CloverConfig(hidden_size=64, vocab_size=256, head_type="medusa", own_lm_heads=True)
    assert CloverConfig.from_dict(medusa.to_dict()).own_lm_heads


def test_linear_output_heads_start_near_the_identity():
    heads = CloverHeads(CloverConfig(hidden_size=64, vocab_size=256, output_head="linear"))
    assert isinstance(heads.output, LinearOutputHeads) and not hasattr(heads, "heads")
    s, e = torch.randn(3, 64), torch.randn(3, 64)
    norm = heads.output.norm
    # W0 = I + U(0, 0.01) and W = [I | 0] + U(0, 0.01): before training, each head passes s on (normed)
    torch.testing.assert_close(heads._head(0, s, e), norm(s), atol=0.2, rtol=0.1)
    torch.testing.assert_close(heads._head(2, s, e), norm(s), atol=0.2, rtol=0.1)
    assert heads._head(1, s, e).shape == (3, 64)
    assert not torch.equal(heads._head(1, s, e), heads._head(0, s, e))


@torch.no_grad()
def test_linear_heads_draft_what_their_form_computes():
    """Along the path of first choices: W0 for the first head, the shared W over [s; e] below it."""
    base = tiny_model("llama")
    heads = random_heads(base, seed=1, output_head="linear")[0].clover_heads
    tree = build_tree([[0], [1], [0, 0], [0, 0, 0]])
    feature, embed = torch.randn(64), base.get_input_embeddings()
    lm_head = heads.draft_lm_head(base.get_output_embeddings())
    drafted, _ = heads.draft(feature, torch.tensor(7), tree, embed, lm_head)
    out, state, token, path = heads.output, feature[None], 7, []
    for d in range(3):
        e = embed(torch.tensor([token]))
        if d:
            state = heads.regressive(state, e)
        h = out.norm(out.first(state)) if d == 0 else out.norm(out.later(torch.cat([state, e], dim=-1)))
        token = int(lm_head(h).argmax())
        path.append(token)
    by_path = dict(zip(tree.paths, drafted.tolist()))
    assert [by_path[(0,)], by_path[(0, 0)], by_path[(0, 0, 0)]] == path


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_linear_output_heads_decode_exactly_and_survive_saving(arch, tmp_path):
    base = tiny_model(arch)
    clover, _ = random_heads(base, seed=2, output_head="linear")
    ids = prompt(5)
    reference = base.generate(ids, max_new_tokens=30, do_sample=False)
    for budget in ("full", "auto"):
        assert same(clover.generate(ids, max_new_tokens=30, do_sample=False, budget=budget), reference)
    clover.save_pretrained(tmp_path / "h")
    assert json.loads((tmp_path / "h" / "config.json").read_text())["output_head"] == "linear"
    loaded = CloverForCausalLM.from_pretrained(tmp_path / "h", base_model=base)
    for name, p in clover.clover_heads.state_dict().items():
        assert torch.equal(loaded.clover_heads.state_dict()[name], p), name
    card = (tmp_path / "h" / "README.md").read_text()
    assert "the output heads are Clover-2's" in card


def test_augmenting_block_final_norm_starts_from_the_bases_on_request():
    base = tiny_model("llama")
    with torch.no_grad():
        base.model.norm.weight.copy_(torch.linspace(0.5, 2.0, 64))
    default = CloverForCausalLM.from_base(base).clover_heads
    assert torch.equal(default.augment_norm.weight, torch.ones(64))  # this library's default
    clover2 = CloverForCausalLM.from_base(base, init_norms_from_base=True, output_head="linear").clover_heads
    assert torch.equal(clover2.augment_norm.weight, base.model.norm.weight)
    assert torch.equal(clover2.output.norm.weight, base.model.norm.weight)
    gemma = tiny_model("gemma3_text")  # scales by (1 + w): nothing to copy into ours
    assert torch.equal(CloverForCausalLM.from_base(gemma, init_norms_from_base=True).clover_heads.augment_norm.weight,
                       torch.ones(64))


def test_medusa_heads_own_projections_start_from_the_bases_rows_and_decode_exactly(tmp_path):
    base = tiny_model("llama")
    medusa = CloverForCausalLM.from_base(base, head_type="medusa", own_lm_heads=True, draft_vocab_size=48)
    heads = medusa.clover_heads
    assert isinstance(heads, MedusaHeads) and len(heads.lm_heads) == heads.config.num_heads
    with torch.no_grad():
        heads.draft_token_ids.copy_(torch.arange(48) * 5)  # a draft vocabulary chosen after construction
    heads.init_projections(base.get_output_embeddings())
    rows = base.lm_head.weight[torch.arange(48) * 5]
    assert all(torch.equal(p.weight, rows) for p in heads.lm_heads)
    hidden = torch.randn(2, 64)
    torch.testing.assert_close(heads.head_logits(1, hidden, heads.draft_lm_head(base.lm_head)), hidden @ rows.T)

    medusa, _ = random_heads(base, seed=4, head_type="medusa", own_lm_heads=True)
    ids = prompt(6)
    reference = base.generate(ids, max_new_tokens=30, do_sample=False)
    assert same(medusa.generate(ids, max_new_tokens=30, do_sample=False, budget="full"), reference)
    medusa.save_pretrained(tmp_path / "m")
    loaded = CloverForCausalLM.from_pretrained(tmp_path / "m", base_model=base)
    assert loaded.clover_config.own_lm_heads
    assert torch.equal(loaded.clover_heads.lm_heads[2].weight, medusa.clover_heads.lm_heads[2].weight)
    card = (tmp_path / "m" / "README.md").read_text()
    assert "weights of its own" in card


def _features(base, tmp_path, seed: int = 3):
    ids = prompt(seed, 8)
    text = base.generate(ids, max_new_tokens=24, do_sample=False)[0].tolist()
    cache_features(base, [Example(text, [0] * 8 + [1] * (len(text) - 8))], tmp_path / "f", top_k=4)
    return FeatureSet.load(tmp_path / "f")


def test_medusa_own_projections_train_and_the_shared_lm_head_stays_frozen(tmp_path):
    base = tiny_model("llama").eval().requires_grad_(False)
    features = _features(base, tmp_path)
    medusa = CloverForCausalLM.from_base(base, head_type="medusa", own_lm_heads=True, num_heads=2,
                                         tree=[[0], [0, 0]])
    before = [p.weight.clone() for p in medusa.clover_heads.lm_heads]
    lm_before = base.lm_head.weight.clone()
    config = TrainConfig(output_dir=str(tmp_path / "o"), head_type="medusa", own_lm_heads=True, max_steps=5,
                         batch_size=1, lr=1e-2, warmup_steps=1, feature_loss_weight=0.0, label_top_k=1,
                         eval_fraction=0, eval_every=0, save_every=1000)
    Trainer(config, medusa.clover_heads, base, features).train(log=lambda *_: None)
    assert all(not torch.equal(p.weight, b) for p, b in zip(medusa.clover_heads.lm_heads, before))
    assert torch.equal(base.lm_head.weight, lm_before)


def test_label_top_k_one_is_cross_entropy_on_the_bases_top_token(tmp_path):
    base = tiny_model("llama").eval().requires_grad_(False)
    features = _features(base, tmp_path)
    clover = CloverForCausalLM.from_base(base, num_heads=2, tree=[[0], [0, 0]])
    heads = clover.clover_heads.float()
    batch = features.batch([0])
    embed, weight = base.get_input_embeddings(), base.lm_head.weight.float()
    _, hard = head_losses(heads, batch, embed, weight, None, None, 1.0, 0.0, label_top_k=1)
    _, soft = head_losses(heads, batch, embed, weight, None, None, 1.0, 0.0)
    # head 0 at t predicts x_{t+2}: its hard-label loss is -log p(the base's top-1 there)
    outs = heads(batch["hidden"][:, :-1], embed(batch["input_ids"][:, 1:]))
    valid = batch["loss_mask"][:, 2 : 2 + outs[0].shape[1]]
    logp = (outs[0][valid] @ weight.T).log_softmax(-1)
    top1 = batch["topk_ids"][:, 1 : 1 + outs[0].shape[1]][valid][:, 0]
    assert hard[0]["loss"] == pytest.approx(-logp.gather(-1, top1[:, None]).mean().item(), rel=1e-5)
    assert soft[0]["loss"] != pytest.approx(hard[0]["loss"], rel=1e-3)
    with pytest.raises(ValueError, match="label_top_k must be >= 1"):
        TrainConfig(output_dir=str(tmp_path / "o"), label_top_k=0)


def test_the_card_names_the_loss_and_initialisation():
    config = CloverConfig(hidden_size=64, vocab_size=256, output_head="linear")
    metrics = {"training": {"steps": 100}, "train_config": {"feature_loss_weight": 10.0, "label_top_k": 1, "head_decay": 0.7,
                                "init_norms_from_base": True, "max_steps": 100}}
    card = render_model_card(config, metrics=metrics)
    assert "cross-entropy on the base's top-1 token, plus 10 x SmoothL1" in card
    assert "final norm started from the base's final norm" in card
    assert "the output heads are Clover-2's" in card



def test_medusa_heads_of_several_blocks_decode_exactly_and_read_one_block_heads(tmp_path):
    """medusa_num_layers stacks residual blocks per head (Medusa-1's option); heads saved when a head was one
    block (weights at heads.{i}.linear) still load, into the first block."""
    from safetensors.torch import load_file, save_file

    from clover_hf.hub.repo import load_heads

    base = tiny_model("llama")
    clover = random_heads(base, seed=3, head_type="medusa", medusa_num_layers=2, tree=[[0], [1], [0, 0]])[0]
    assert len(clover.clover_heads.heads[0]) == 2
    ids = prompt(4)
    assert same(clover.generate(ids, max_new_tokens=24, do_sample=False, budget="full"),
                base.generate(ids, max_new_tokens=24, do_sample=False))
    clover.save_pretrained(tmp_path / "two")
    assert load_file(tmp_path / "two" / "model.safetensors").keys() >= {"heads.0.1.linear.weight"}
    one = random_heads(base, seed=4, head_type="medusa", tree=[[0], [0, 0]])[0]
    one.save_pretrained(tmp_path / "one")
    path = tmp_path / "one" / "model.safetensors"
    state = load_file(path)
    legacy = {k.replace(".0.linear.", ".linear."): v for k, v in state.items()}
    assert "heads.1.linear.bias" in legacy
    save_file(legacy, str(path))
    again = load_heads(tmp_path / "one")
    for name, tensor in one.clover_heads.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="medusa_num_layers"):
        CloverConfig(hidden_size=64, vocab_size=256, medusa_num_layers=2)


CLOVER2_OPTIONS = dict(head_input="pre_norm", decoder_bias=True, embed_from_lm_head=True, output_head="linear",
                       num_augment_layers=2)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "gpt2"])
def test_clover2_input_options_decode_exactly(arch):
    """The heads read the base's states before its final norm, embed tokens with the lm_head's rows and have
    biased decoders (Clover-2's code): greedy output is still the base's, token for token."""
    base = tiny_model(arch)
    if arch == "gpt2":  # an untied lm_head, so the lm_head's rows are not the input embeddings
        base.lm_head.weight = torch.nn.Parameter(torch.randn_like(base.lm_head.weight) * 0.02)
    clover = random_heads(base, seed=2, **CLOVER2_OPTIONS)[0]
    for seed in (1, 2):
        ids = prompt(seed)
        for budget in ("full", "auto"):
            assert same(clover.generate(ids, max_new_tokens=30, do_sample=False, budget=budget),
                        base.generate(ids, max_new_tokens=30, do_sample=False))


def test_pre_norm_heads_read_the_final_norms_input_and_lm_head_rows():
    """What decoding hands the heads: the input of the base's final norm, and tokens embedded by lm_head rows."""
    from clover_hf.base.forward import base_forward
    from clover_hf.base.parts import norm_inputs

    base = tiny_model("llama")
    ids = prompt(3)
    with torch.no_grad():
        out = base(ids, output_hidden_states=True)
        _, pre = base_forward(base, ids, None, None, None, pre_norm=True)
        _, post = base_forward(base, ids, None, None, None)
    torch.testing.assert_close(post, out.hidden_states[-1])
    torch.testing.assert_close(base.model.norm(pre), post)
    assert not torch.allclose(pre, post)
    heads = CloverHeads(CloverConfig.for_base(base.config, embed_from_lm_head=True))
    base.lm_head.weight = torch.nn.Parameter(torch.randn_like(base.lm_head.weight))  # untie
    assert torch.equal(heads.token_embedding(base)(ids), base.lm_head.weight[ids])
    assert not torch.equal(heads.token_embedding(base)(ids), base.get_input_embeddings()(ids))
    with pytest.raises(ValueError, match="final norm"):
        with norm_inputs(torch.nn.Linear(2, 2)):
            pass


def test_pre_norm_heads_train_online_only(tmp_path):
    from clover_hf.training.packing import PackedRows

    base = tiny_model("llama").requires_grad_(False)
    clover = CloverForCausalLM.from_base(base, num_heads=2, draft_vocab_size=64, **CLOVER2_OPTIONS)
    rows = PackedRows.pack([Example(prompt(i, 12)[0].tolist(), [1] * 12) for i in range(6)], 24, 0)
    config = TrainConfig(output_dir=str(tmp_path / "o"), max_steps=6, batch_size=2, eval_fraction=0, save_every=100,
                         eval_every=0, warmup_steps=1, labels="full")
    trainer = Trainer(config, clover.clover_heads, base, rows, top_k=4)
    batch = trainer._device_batch([0, 1])
    torch.testing.assert_close(base.model.norm(batch["inputs"]), batch["hidden"], rtol=1e-4, atol=1e-5)
    first, _ = trainer._losses(batch)
    trainer.train(log=lambda *_: None)
    assert trainer._losses(batch)[0].item() < first.item()
    cache_features(base, [Example(prompt(1, 12)[0].tolist(), [1] * 12)], tmp_path / "f", top_k=4)
    with pytest.raises(ValueError, match="--online"):
        Trainer(config, clover.clover_heads, base, FeatureSet.load(tmp_path / "f"))
