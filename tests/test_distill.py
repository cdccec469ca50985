"""Self-distillation by Clover: the features decoding records are the base's own at every position, with the output
unchanged; a run writes shards with a manifest, resumes where it stopped, refuses other settings, and trains."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clover_hf import CloverForCausalLM
from clover_hf.decode.record import FeatureRecord
from clover_hf.tools.cli import main as cli_main
from clover_hf.training import distill as distilling
from clover_hf.training.distill import MANIFEST, Manifest, distill, distill_settings
from clover_hf.training.features import FeatureSet, base_targets
from clover_hf.training.trainer import TrainConfig, Trainer

from .tiny import left_padded, prompt, random_heads, same, save_tiny_base, tiny_model


def check_own(record_row, text: torch.Tensor, prompt_len: int, own: dict, states_key: str = "hidden") -> None:
    """One row's recorded features against the base's own forward over its whole text (1, L)."""
    got, n = record_row.tensors(), text.shape[1] - 1
    assert got["states"].shape[0] == got["topk_ids"].shape[0] == n  # every position but the last
    torch.testing.assert_close(got["states"].float(), own[states_key][0, :n], rtol=0.02, atol=0.02)  # kept in bf16
    at = slice(prompt_len - 1, n)  # the prompt's last position, then every generated one
    assert torch.equal(got["topk_ids"][at, 0], own["topk_ids"][0, at, 0].int())
    torch.testing.assert_close(got["topk_probs"][at].float(), own["topk_probs"][0, at], rtol=0.01, atol=2e-3)
    assert not got["topk_probs"][: prompt_len - 1].any()  # the prefill gives no logits there


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_recorded_features_are_the_bases_own_at_every_position(arch):
    """Float32 greedy: the output stays plain `generate`'s, and the states and top-k the call recorded are those of
    the base's own forward over the text, at every position."""
    base = tiny_model(arch)
    clover, _ = random_heads(base, lookup_tokens=3)
    ids = prompt(2, 9)
    ref = base.generate(ids, max_new_tokens=24, do_sample=False)
    record = FeatureRecord(top_k=8)
    out = clover.generate(ids, max_new_tokens=24, do_sample=False, clover_record=record)
    assert same(out, ref) and len(record.rows) == 1
    check_own(record.rows[0], out, ids.shape[1], base_targets(base, out, 8))


def test_a_left_padded_batch_records_each_row_apart():
    base = tiny_model("llama")
    clover, _ = random_heads(base, lookup_tokens=3)
    prompts = [prompt(3, 7), prompt(4, 12)]
    ids, mask, pads = left_padded(*prompts)
    record = FeatureRecord(top_k=4)
    out = clover.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, clover_record=record)
    for b, (p, pad) in enumerate(zip(prompts, pads)):
        text = out[b : b + 1, pad:]
        assert same(text, base.generate(p, max_new_tokens=16, do_sample=False))
        check_own(record.rows[b], text, p.shape[1], base_targets(base, text, 4))


def test_heads_reading_taps_record_the_fused_states():
    base = tiny_model("llama", num_hidden_layers=3)
    clover, _ = random_heads(base, lookup_tokens=3, feature_layers=[0, 1])
    ids = prompt(5, 8)
    record = FeatureRecord(top_k=4)
    out = clover.generate(ids, max_new_tokens=12, do_sample=False, clover_record=record)
    assert same(out, base.generate(ids, max_new_tokens=12, do_sample=False))
    assert record.rows[0].tensors()["states"].shape[1] == 3 * base.config.hidden_size
    check_own(record.rows[0], out, ids.shape[1], base_targets(base, out, 4, taps=(0, 1)), states_key="inputs")


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("base"))


def _run(tiny_base, tmp_path, answer=None, **settings_changes):
    base = AutoModelForCausalLM.from_pretrained(tiny_base).eval()
    clover, _ = random_heads(base, lookup_tokens=3)
    tok = AutoTokenizer.from_pretrained(tiny_base)
    prompts = [[{"role": "user", "content": "q" * (i + 1)}] for i in range(5)]
    settings = {**distill_settings(clover, prompts, tiny_base, "random", 4, 6, 512), **settings_changes}
    return distill(clover, tok, prompts, tmp_path / "d", settings, batch_size=2, shard_tokens=1, log=lambda *_: None)[0]


def test_a_run_writes_shards_resumes_where_it_stopped_and_refuses_other_settings(tiny_base, tmp_path, monkeypatch):
    """Interrupted after two batches: the manifest names their complete shards; run again, only the prompt left is
    answered. The shards hold every sequence once (prompt, then 6 answer tokens to learn), and train heads."""
    real, answered = distilling._answer, []

    def answer(clover, prompts, pad_id, settings):
        if len(answered) == 2:
            raise KeyboardInterrupt  # the session ends mid-run
        answered.append(len(prompts))
        return real(clover, prompts, pad_id, settings)

    monkeypatch.setattr(distilling, "_answer", answer)
    with pytest.raises(KeyboardInterrupt):
        _run(tiny_base, tmp_path)
    first = Manifest.read(tmp_path / "d")
    assert len(first.shards) == 2 and first.done == {0, 1, 2, 3}  # shortest first
    answered.clear()
    monkeypatch.setattr(distilling, "_answer", lambda *args: answered.append(len(args[1])) or real(*args))
    manifest = _run(tiny_base, tmp_path)
    assert answered == [1] and manifest.done == {0, 1, 2, 3, 4} and len(manifest.shards) == 3
    assert json.loads((tmp_path / "d" / MANIFEST).read_text())["shards"][2]["prompts"] == [4]
    features = FeatureSet.load(tmp_path / "d")
    assert len(features) == 5 and features.tokens == manifest.tokens
    assert all(int(features.batch([i])["loss_mask"].sum()) == 6 for i in range(5))  # the answer's tokens
    with pytest.raises(ValueError, match="other settings.*top_k"):
        _run(tiny_base, tmp_path, top_k=8)

    base = AutoModelForCausalLM.from_pretrained(tiny_base).eval().requires_grad_(False)
    clover = CloverForCausalLM.from_base(base, num_heads=2, draft_vocab_size=64)
    config = TrainConfig(output_dir=str(tmp_path / "o"), max_steps=3, batch_size=2, eval_fraction=0, save_every=100,
                         eval_every=0, warmup_steps=1)
    trainer = Trainer(config, clover.clover_heads, base, features, top_k=4)
    first_loss, _ = trainer._losses(trainer._device_batch([0, 1]))
    assert torch.isfinite(first_loss)
    trainer.train(log=lambda *_: None)


def test_the_distill_command_answers_data_into_the_directory_named(tiny_base, tmp_path, capsys):
    base = AutoModelForCausalLM.from_pretrained(tiny_base)
    clover, _ = random_heads(base)
    clover.save_pretrained(tmp_path / "heads")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                     {"role": "assistant", "content": "an answer"}]}) + "\n"
                            for i in range(3)))
    args = ["distill", "--heads", str(tmp_path / "heads"), "--base-model", tiny_base, "--data", str(data),
            "--dtype", "float32", "--max-new-tokens", "5", "--batch-size", "2", "--out", str(tmp_path / "out")]
    assert cli_main(args) == 0
    assert Manifest.read(tmp_path / "out").done == {0, 1, 2}
    assert "--features " + str(tmp_path / "out") in capsys.readouterr().out
