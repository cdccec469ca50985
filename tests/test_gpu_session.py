"""The GPU session's one command, end to end on the CPU with a tiny base and a few steps: every stage runs,
a later call continues where an earlier one stopped, and the heads that come back decode exactly."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from clover_hf import CloverForCausalLM

from .test_training import _chats
from .tiny import prompt, save_tiny_base

REPO = Path(__file__).resolve().parents[1]


def _session_module():
    spec = importlib.util.spec_from_file_location("gpu_session", REPO / "examples" / "gpu_session.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_session_end_to_end_on_cpu(tmp_path, capsys):
    session = _session_module()
    base = save_tiny_base(tmp_path / "base")
    chats = _chats(tmp_path / "chats.jsonl", n=16)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i} plus {i}?"}) + "\n" for i in range(3)))
    work, out = tmp_path / "work", tmp_path / "out"
    args = ["run", "--device", "cpu", "--base-model", base, "--data", str(chats), "--prompts", str(prompts),
            "--work-dir", str(work), "--out", str(out), "--num-heads", "3", "--draft-vocab-size", "64",
            "--max-length", "96", "--epochs", "2", "--batch-size", "4", "--warmup-steps", "2", "--workers", "1",
            "--distill-max-new-tokens", "8", "--distill-batch-size", "4", "--accuracy-limit", "2",
            "--bench-limit", "2", "--max-new-tokens", "12"]
    # a first call that gets as far as Clover's training, a second that does the rest
    assert session.main(args + ["--skip", "train-medusa", "accuracy", "bench-static", "bench-new", "bench-old"]) == 0
    done = {p.stem for p in work.glob("*.done")}
    assert done == {"cuda-tests", "cuda-tests-shipped", "distill", "train-clover"}
    answers = (work / "answers.jsonl").read_text()
    assert len(answers.splitlines()) == 16
    heads_mtime = (work / "clover" / "heads" / "model.safetensors").stat().st_mtime
    assert session.main(args) == 0
    assert capsys.readouterr().out.rstrip().endswith("DONE")
    assert {p.stem for p in work.glob("*.done")} == done | {"train-medusa", "accuracy", "bench-static", "bench-new",
                                                            "bench-old"}
    assert (work / "answers.jsonl").read_text() == answers  # nothing done twice
    assert (work / "clover" / "heads" / "model.safetensors").stat().st_mtime == heads_mtime

    clover_cfg = json.loads((work / "clover" / "heads" / "config.json").read_text())
    assert clover_cfg["num_augment_layers"] == 2 and clover_cfg["output_head"] == "linear"
    assert clover_cfg["head_input"] == "pre_norm" and clover_cfg["decoder_bias"]
    medusa_cfg = json.loads((work / "medusa" / "heads" / "config.json").read_text())
    assert medusa_cfg["head_type"] == "medusa" and medusa_cfg["own_lm_heads"]
    for name in ("clover", "medusa"):  # same data and tokens for both
        metrics = json.loads((work / name / "heads" / "training_metrics.json").read_text())
        assert metrics["data_config"]["online"] and len(metrics["eval"]) == 3
    trained = [json.loads((work / n / "heads" / "training_metrics.json").read_text())["training"]
               for n in ("clover", "medusa")]
    assert trained[0]["tokens"] == trained[1]["tokens"] and trained[0]["steps"] == trained[1]["steps"]
    rows = json.loads((out / "accuracy.json").read_text())
    assert [Path(r["heads"]).parent.name for r in rows] == ["clover", "medusa"]
    assert all(r[s]["identical"] == 2 for r in rows for s in ("heads alone", "with chain"))
    assert "clover (auto)" in (work / "bench-new" / "results.md").read_text()
    static = (work / "bench-static" / "results.md").read_text()
    assert "| plain generate, static+compiled |" in static and "| clover, static+compiled |" in static
    assert "## accuracy" in (out / "summary.md").read_text()

    session.collect(out)
    clover = CloverForCausalLM.from_pretrained(out / "clover-heads", base_model=base)
    ids = prompt(5)
    assert torch.equal(clover.generate(ids, max_new_tokens=20, do_sample=False, budget="full"),
                       clover.base_model.generate(ids, max_new_tokens=20, do_sample=False))


def test_a_stage_is_stopped_at_the_calls_deadline(tmp_path):
    """A command still running when the call's minutes are up is killed and reported as not done, so the
    call ends before the lease's limit and the next call runs the stage again."""
    import argparse
    import sys
    import time

    session = _session_module()
    args = argparse.Namespace(work_dir=str(tmp_path), minutes=2 / 60)
    s = session.Session(args)
    start = time.monotonic()
    assert s.sh("sleeper", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]) is None
    assert time.monotonic() - start < 30
    assert "started" in (tmp_path / "logs" / "sleeper.log").read_text()
