"""Training: the loss and a step, the CLI end to end, self-distillation, exact resume, DDP, bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from clover_hf import CloverForCausalLM
from clover_hf.tools.cli import main as cli_main
from clover_hf.training.features import Example, FeatureSet, cache_features
from clover_hf.training.trainer import TrainConfig, Trainer, head_losses

from .tiny import prompt, save_tiny_base

REPO = Path(__file__).resolve().parents[1]


def _chats(path: Path, n: int = 24) -> Path:
    lines = []
    for i in range(n):
        lines.append(json.dumps({"messages": [
            {"role": "user", "content": f"question {i}: what is {i} plus {i}?"},
            {"role": "assistant", "content": f"The answer is {2 * i}. " * 3},
        ]}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("base"))


def two_process_launch() -> list[str]:
    """`accelerate launch` of two CPU processes, on a port free now: the default one may still be held by an
    earlier launch's lingering process, or by another run on the machine."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
            "--main_process_port", str(port), "--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]


def _args(base: str, data: Path, out: Path, **extra) -> list[str]:
    args = {"base-model": base, "data": str(data), "output-dir": str(out), "base-dtype": "float32",
            "max-steps": "12", "batch-size": "4", "save-every": "4", "eval-every": "0", "max-length": "64",
            "draft-vocab-size": "64", "num-heads": "3", "warmup-steps": "2", **extra}
    flat = ["train"]
    for k, v in args.items():
        flat += [f"--{k}", v] if v is not None else [f"--{k}"]
    return flat


def test_training_step_changes_heads_not_base(tiny_base, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_base).eval().requires_grad_(False)
    examples = [Example(prompt(i, 20)[0].tolist(), [0] * 5 + [1] * 15) for i in range(6)]
    cache_features(base, examples, tmp_path / "f", top_k=4)
    features = FeatureSet.load(tmp_path / "f")
    assert len(features) == 6 and features.read("hidden").shape == (120, 64)
    clover = CloverForCausalLM.from_base(base, num_heads=3, tree=[[0], [0, 0], [0, 0, 0]])
    base_before = {k: v.clone() for k, v in base.state_dict().items()}
    heads_before = {k: v.clone() for k, v in clover.clover_heads.state_dict().items()}
    trainer = Trainer(TrainConfig(output_dir=str(tmp_path / "o"), max_steps=5, batch_size=3, eval_fraction=0,
                                  save_every=100, eval_every=0, warmup_steps=1), clover.clover_heads, base, features)
    batch = trainer._device_batch([0, 1, 2])
    first, stats = head_losses(trainer.heads, batch, trainer.embed, trainer.lm_weight, None, None, 0.7, 1.0)
    assert len(stats) == 3 and all(0 <= s["top1"] <= s["top5"] <= 1 for s in stats)
    trainer.train(log=lambda *_: None)
    last, _ = head_losses(trainer.heads, batch, trainer.embed, trainer.lm_weight, None, None, 0.7, 1.0)
    assert last.item() < first.item()
    assert all(torch.equal(v, base_before[k]) for k, v in base.state_dict().items())
    changed = [k for k, v in trainer.heads.state_dict().items() if not torch.equal(v, heads_before[k])]
    assert any("heads.0.fc" in k for k in changed) and any("augment" in k for k in changed)


def test_feature_sets_from_several_runs_must_match(tiny_base, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_base).eval().requires_grad_(False)
    examples = [Example(prompt(i, 12)[0].tolist(), [1] * 12) for i in range(3)]
    cache_features(base, examples, tmp_path / "a", top_k=4)
    cache_features(base, examples[:2], tmp_path / "b", top_k=4)
    cache_features(base, examples, tmp_path / "c", top_k=8)
    both = FeatureSet.load(tmp_path / "a", tmp_path / "b")
    assert len(both) == 5
    assert torch.equal(both.read("input_ids")[36:60], FeatureSet.load(tmp_path / "b").read("input_ids"))
    with pytest.raises(ValueError, match="topk_ids.*cannot be mixed"):
        FeatureSet.load(tmp_path / "a", tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="no feature shards"):
        FeatureSet.load(tmp_path / "a", tmp_path / "missing")


def test_cli_train_writes_loadable_heads(tiny_base, tmp_path):
    out = tmp_path / "run"
    assert cli_main(_args(tiny_base, _chats(tmp_path / "chats.jsonl"), out)) == 0
    heads = out / "heads"
    assert {"config.json", "model.safetensors", "training_metrics.json"} <= {p.name for p in heads.iterdir()}
    metrics = json.loads((heads / "training_metrics.json").read_text())
    assert metrics["training"]["steps"] == 12 and len(metrics["eval"]) == 3
    state = load_file(heads / "model.safetensors")
    assert state["draft_token_ids"].shape == (64,)
    clover = CloverForCausalLM.from_pretrained(heads)  # the base is named in the heads' config
    ids = prompt(3)
    assert torch.equal(clover.generate(ids, max_new_tokens=20, do_sample=False),
                       clover.base_model.generate(ids, max_new_tokens=20, do_sample=False))


def test_continue_from_heads_with_earlier_features(tiny_base, tmp_path, cli_error):
    """--init-heads starts from trained heads; --extra-features adds an earlier run's cached features."""
    first = tmp_path / "first"
    assert cli_main(_args(tiny_base, _chats(tmp_path / "a.jsonl"), first)) == 0
    (earlier,) = first.glob("features-*")
    second = tmp_path / "second"
    more = _chats(tmp_path / "b.jsonl", n=8)
    # lr 0: the heads must come out exactly as they went in
    assert cli_main(_args(tiny_base, more, second, **{"init-heads": str(first / "heads"), "lr": "0",
                                                       "extra-features": str(earlier)})) == 0
    before, after = load_file(first / "heads" / "model.safetensors"), load_file(second / "heads" / "model.safetensors")
    for name, tensor in before.items():
        if name != "draft_token_ids":
            assert torch.equal(tensor, after[name]), name
    (own,) = second.glob("features-*")
    assert len(FeatureSet.load(own, earlier)) == 8 + 24
    metrics = json.loads((second / "heads" / "training_metrics.json").read_text())
    assert metrics["training"]["sequences"] == 32
    assert re.search("num_heads", cli_error(_args(tiny_base, more, tmp_path / "third", **{"init-heads": str(first / "heads"), "num-heads": "2"})))


@pytest.mark.parametrize("options, config_fields", [
    ({"output-head": "linear", "init-norms-from-base": None, "feature-loss-weight": "10"}, {"output_head": "linear"}),
    ({"head-type": "medusa", "own-lm-heads": None, "feature-loss-weight": "0", "label-top-k": "1"},
     {"head_type": "medusa", "own_lm_heads": True}),
])
def test_cli_trains_with_clover2_and_medusa1_options(tiny_base, tmp_path, options, config_fields):
    """The ablation switches reach the heads, the loss and the card; Medusa-1's own projections keep
    the draft vocabulary they were trained on when a run continues from them."""
    first = tmp_path / "first"
    assert cli_main(_args(tiny_base, _chats(tmp_path / "a.jsonl"), first, **options)) == 0
    config = json.loads((first / "heads" / "config.json").read_text())
    assert config_fields.items() <= config.items()
    card = (first / "heads" / "README.md").read_text()
    assert "Loss per head" in card
    clover = CloverForCausalLM.from_pretrained(first / "heads")
    ids = prompt(3)
    assert torch.equal(clover.generate(ids, max_new_tokens=20, do_sample=False, budget="full"),
                       clover.base_model.generate(ids, max_new_tokens=20, do_sample=False))
    second = tmp_path / "second"
    more = _chats(tmp_path / "b.jsonl", n=8)  # other data: another draft vocabulary would be chosen
    assert cli_main(_args(tiny_base, more, second, **options, **{"init-heads": str(first / "heads"), "lr": "0"})) == 0
    before, after = load_file(first / "heads" / "model.safetensors"), load_file(second / "heads" / "model.safetensors")
    for name, tensor in before.items():
        if name != "draft_token_ids" or "own-lm-heads" in options:
            assert torch.equal(tensor, after[name]), name


def test_self_distillation_is_cached_and_resumed(tiny_base, tmp_path):
    out = tmp_path / "run"
    args = _args(tiny_base, _chats(tmp_path / "chats.jsonl", n=8), out, **{
        "self-distill": None, "distill-max-new-tokens": "12", "distill-batch-size": "3", "max-steps": "2"})
    cli_main(args)
    distilled = [json.loads(l) for l in (out / "selfdistill-r0-w1.jsonl").read_text().splitlines()]
    assert len(distilled) == 8
    base = AutoModelForCausalLM.from_pretrained(tiny_base)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_base)
    first = distilled[0]["messages"]
    ids = tok.apply_chat_template(first[:1], add_generation_prompt=True, return_tensors="pt", return_dict=False)
    reply = base.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    assert first[-1]["content"] == tok.decode(reply, skip_special_tokens=True).strip()
    mtime = (out / "selfdistill-r0-w1.jsonl").stat().st_mtime
    cli_main(args)  # everything cached: nothing generated again
    assert (out / "selfdistill-r0-w1.jsonl").stat().st_mtime == mtime


def _run_cli(args: list[str], **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "clover_hf.tools.cli", *args], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def test_interrupted_training_resumes_exactly(tiny_base, tmp_path):
    data = _chats(tmp_path / "chats.jsonl")
    extra = {"max-steps": "40", "save-every": "5"}
    cli_main(_args(tiny_base, data, tmp_path / "straight", **extra))  # the uninterrupted reference, in this process

    interrupted = tmp_path / "interrupted"
    shutil.copytree(tmp_path / "straight", interrupted, ignore=shutil.ignore_patterns("checkpoints", "heads"))
    proc = _run_cli(_args(tiny_base, data, interrupted, **extra))
    deadline = time.time() + 240
    while time.time() < deadline and not list((interrupted / "checkpoints").glob("step-0000010")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (interrupted / "heads").exists(), "the run finished before it could be interrupted"
    resumed = _run_cli(_args(tiny_base, data, interrupted, **extra))
    log = resumed.stdout.read().decode()
    assert resumed.wait(timeout=300) == 0, log[-2000:]
    assert "resumed from step" in log
    a = load_file(tmp_path / "straight" / "heads" / "model.safetensors")
    b = load_file(interrupted / "heads" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_accelerate_launch_two_processes_and_resume(tiny_base, tmp_path):
    """DDP over two CPU processes (gloo): each process distills and caches its share; a run stopped after
    a checkpoint resumes from it, both processes together, and ends with the same heads."""
    data = _chats(tmp_path / "chats.jsonl")
    out = tmp_path / "ddp"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")

    def launch(directory: Path) -> str:
        cmd = [*two_process_launch(), "-m", "clover_hf.tools.cli",
               *_args(tiny_base, data, directory, **{"self-distill": None, "distill-max-new-tokens": "6"})]
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-12000:]
        return proc.stdout + proc.stderr

    launch(out)
    metrics = json.loads((out / "heads" / "training_metrics.json").read_text())
    assert metrics["training"]["processes"] == 2
    assert sorted(p.name for p in out.glob("selfdistill-*.jsonl")) == ["selfdistill-r0-w2.jsonl", "selfdistill-r1-w2.jsonl"]
    assert len(list(out.glob("features-*-w2/shard-r1-*"))) == 1  # each process cached its own share
    CloverForCausalLM.from_pretrained(out / "heads")

    # as if killed after step 8's checkpoint (of 12): the final heads and later checkpoints are gone
    stopped = tmp_path / "stopped"
    shutil.copytree(out, stopped, ignore=shutil.ignore_patterns("heads", "step-0000012"))
    assert [p.name for p in (stopped / "checkpoints").iterdir()] == ["step-0000008"]
    assert "resumed from step 8" in launch(stopped)
    a, b = load_file(out / "heads" / "model.safetensors"), load_file(stopped / "heads" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


@pytest.mark.parametrize(
    "content, words",
    [("", "empty"), ('{"messages": [{"role": "user", "content": "hi"}]\n', "line 1"),
     ('{"messages": [{"role": "wizard", "content": "hi"}]}\n', "wizard")],
)
def test_bad_data_fails_before_work(tiny_base, tmp_path, content, words, cli_error):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    assert re.search(words, cli_error(_args(tiny_base, bad, tmp_path / "o")))
    assert not (tmp_path / "o" / "checkpoints").exists()


def test_too_long_sequences_and_unsupported_base_fail_early(tiny_base, tmp_path, cli_error):
    data = _chats(tmp_path / "c.jsonl")
    assert re.search("exceeds the base's context of 512", cli_error(_args(tiny_base, data, tmp_path / "o", **{"max-length": "4096"})))
    from transformers import AutoConfig

    bloom = tmp_path / "bloom"
    AutoModelForCausalLM.from_config(AutoConfig.for_model("bloom", vocab_size=64, hidden_size=32, n_layer=1, n_head=2)).save_pretrained(bloom)
    assert re.search("ALiBi", cli_error(_args(str(bloom), data, tmp_path / "o2")))


def test_self_distill_file_cut_short_is_repaired(tiny_base, tmp_path):
    from transformers import AutoTokenizer

    from clover_hf.training.features import read_distilled, self_distill

    base = AutoModelForCausalLM.from_pretrained(tiny_base)
    tok = AutoTokenizer.from_pretrained(tiny_base)
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(4)]
    path = tmp_path / "d.jsonl"
    self_distill(base, tok, prompts[:2], path, max_new_tokens=4, batch_size=2)
    path.write_text(path.read_text() + '{"index": 2, "messa')  # killed mid-write
    out = self_distill(base, tok, prompts, path, max_new_tokens=4, batch_size=2)
    assert len(out) == 4 and sorted(r["index"] for r in read_distilled(path)) == [0, 1, 2, 3]


def test_conversations_for_a_base_without_chat_template_fail_before_it_loads(tmp_path, monkeypatch, cli_error):
    """A base whose tokenizer has no chat template cannot format conversations: a clear error before the
    base loads; plain text trains."""
    from .tiny import byte_tokenizer, tiny_model

    base_dir = tmp_path / "plain-base"
    tiny_model("llama").save_pretrained(base_dir)
    tok = byte_tokenizer()
    tok.pad_token = tok.convert_ids_to_tokens(0)
    tok.save_pretrained(base_dir)
    chats = _chats(tmp_path / "chats.jsonl")
    import clover_hf.training.pipeline as pipeline

    real = pipeline.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(pipeline.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the base was loaded"))
    assert re.search("has no chat template.*--data notes.txt", cli_error(_args(str(base_dir), chats, tmp_path / "o")))
    monkeypatch.setattr(pipeline.AutoModelForCausalLM, "from_pretrained", real)
    notes = tmp_path / "notes.txt"
    notes.write_text("\n\n".join(f"Note {i}: the answer to {i} plus {i} is {2 * i}." for i in range(30)))
    cli_main(_args(str(base_dir), notes, tmp_path / "o2", **{"max-steps": "2"}))
    CloverForCausalLM.from_pretrained(tmp_path / "o2" / "heads", base_model=str(base_dir))


def test_label_mask_keeps_the_contexts_decoding_reaches():
    """Head i at t reads x_{t+1}..x_{t+1+i}: it learns there only where each was among the base's k likeliest."""
    from clover_hf.training.trainer import reached

    x = torch.tensor([[5, 1, 2, 3, 4, 6]])
    best = torch.tensor([[1, 2, 9, 4, 6, 0]])  # the base's top-1 at each position: x_2 = 3 is not (it chose 9)
    second = torch.tensor([[7, 7, 3, 7, 7, 7]])  # its second choice there was 3
    top = torch.stack([best, second], -1)
    assert reached(x, top, 1, 0, 5).tolist() == [[True, True, False, True, True]]
    assert reached(x, top, 1, 1, 4).tolist() == [[True, False, False, True]]
    assert reached(x, top, 1, 2, 3).tolist() == [[False, False, False]]
    assert reached(x, top, 2, 2, 3).all()


def test_label_mask_trains_on_fewer_positions_and_evaluates_on_all(tiny_base, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_base).eval().requires_grad_(False)
    # random prompts (rarely the base's choices), then the base's own greedy answers (its choices throughout)
    texts = [base.generate(prompt(i, 8), max_new_tokens=12, do_sample=False)[0].tolist() for i in range(4)]
    examples = [Example(text, [1] * len(text)) for text in texts]
    cache_features(base, examples, tmp_path / "f", top_k=4)
    features = FeatureSet.load(tmp_path / "f")
    clover = CloverForCausalLM.from_base(base, num_heads=2, tree=[[0], [0, 0]])
    config = TrainConfig(output_dir=str(tmp_path / "o"), max_steps=2, batch_size=4, eval_fraction=0,
                         save_every=100, eval_every=0, warmup_steps=1, label_mask=1)
    trainer = Trainer(config, clover.clover_heads, base, features)
    batch = trainer._device_batch([0, 1, 2, 3])
    _, masked = trainer._losses(batch)
    _, every = trainer._losses(batch, mask=False)
    assert all(0 < m["n"] < e["n"] for m, e in zip(masked, every))
    assert masked[1]["n"] < masked[0]["n"]  # deeper heads read more tokens: fewer contexts reached
    with pytest.raises(ValueError, match="label_mask"):
        TrainConfig(output_dir="o", label_mask=0)


def test_runs_with_other_seeds_hold_out_the_same_sequences_under_one_eval_seed(tiny_base, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_base).eval().requires_grad_(False)
    cache_features(base, [Example(prompt(i, 12)[0].tolist(), [1] * 12) for i in range(20)], tmp_path / "f", top_k=4)
    features = FeatureSet.load(tmp_path / "f")

    def held_out(**kwargs) -> list[int]:
        heads = CloverForCausalLM.from_base(base, num_heads=2, draft_vocab_size=64).clover_heads
        config = TrainConfig(output_dir=str(tmp_path / "o"), eval_fraction=0.25, **kwargs)
        return Trainer(config, heads, base, features, top_k=4).eval_ids

    assert held_out(seed=0) != held_out(seed=1)  # by default the seed picks them
    assert held_out(seed=0, eval_seed=0) == held_out(seed=1, eval_seed=0) == held_out(seed=0)

