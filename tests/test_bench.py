"""The benchmark harness on a tiny model: every method runs on every prompt, and the table adds up."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from clover_hf import CloverForCausalLM
from clover_hf.tools.bench import (
    MethodResult,
    encode_batches,
    markdown_table,
    read_prompts,
    run_benchmark,
    slowest_prompts,
    speculation_shares,
)
from clover_hf.tools.cli import main

from .tiny import CHAT_TEMPLATE, byte_tokenizer, save_tiny_base, tiny_model


def _tiny_clover():
    """A tiny base, a byte tokenizer with a chat template, and fresh Clover heads on the base."""
    base = tiny_model("llama")
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return base, tok, CloverForCausalLM.from_base(base)


def test_run_benchmark_interleaves_methods(tmp_path):
    _, tok, clover = _tiny_clover()
    prompts = ["hello", "a longer prompt here"]
    results = run_benchmark(clover, tok, prompts, max_new_tokens=12, warmup=1, log=lambda *_: None)
    assert list(results) == ["plain generate", "clover, one-token steps", "clover", "prompt lookup (10)"]
    for r in results.values():
        assert r.prompts == 2 and r.new_tokens == 24 and r.seconds > 0
    assert results["clover"].identical == 2  # greedy fp32: same tokens as plain generate
    assert len(results["clover"].accepted_lengths) == results["clover"].steps - 2  # two prefills, one per prompt
    one = results["clover, one-token steps"]
    assert one.identical == 2 and one.verified_per_step == 1.0 and one.steps == 24  # Clover's kernels, no speculation
    table = markdown_table(results, clover.clover_config.num_heads)
    assert table.count("\n") == 5 and "| clover |" in table and "2/2" in table
    shares = speculation_shares(results)
    speed = results["clover"].tokens_per_second / one.tokens_per_second
    assert "one-token steps" in shares and f"clover {speed:.2f}x its one-token steps" in shares


def test_read_prompts_sources(tmp_path):
    assert len(read_prompts("mtbench", None)) == 80
    assert len(read_prompts(None, 5)) == 5
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"turns": ["b", "c"]}\n')
    assert read_prompts(str(tmp_path / "p.jsonl"), None) == ["a", "b"]
    (tmp_path / "p.txt").write_text("x\n\ny\n")
    assert read_prompts(str(tmp_path / "p.txt"), None) == ["x", "y"]


def _bench(tmp_path, prompts: str, *extra: str) -> Path:
    """Run `clover-hf bench` on a tiny saved base with fresh heads; returns the output directory."""
    base_dir = save_tiny_base(tmp_path / "base")
    CloverForCausalLM.from_base(AutoModelForCausalLM.from_pretrained(base_dir)).save_pretrained(tmp_path / "heads")
    (tmp_path / "p.txt").write_text(prompts)
    out = tmp_path / "out"
    main(["bench", "--heads", str(tmp_path / "heads"), "--base-model", base_dir, "--dtype", "float32",
          "--prompts", str(tmp_path / "p.txt"), "--out-dir", str(out), *extra])
    return out


def test_bench_command_writes_results(tmp_path):
    out = _bench(tmp_path, "first prompt\nsecond prompt\n", "--max-new-tokens", "8")
    text = (out / "results.md").read_text()
    assert "2 prompts" in text and "| clover |" in text and "2/2" in text and "what speculation adds: clover" in text
    assert "clover's draft settings, unless a variant overrides them: static, 25 nodes, depth 4" in text
    assert (out / "results.json").is_file()


def test_bench_default_device_is_an_available_accelerator(tmp_path, monkeypatch):
    """A CUDA build of torch on a machine without a GPU still names CUDA as its accelerator: the bench
    must then run on the CPU, not fail moving the model."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    out = _bench(tmp_path, "first prompt\n", "--max-new-tokens", "4", "--no-prompt-lookup")
    assert "1/1" in (out / "results.md").read_text()
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):  # an explicit --device is taken as given
            _bench(tmp_path / "gpu", "first prompt\n", "--max-new-tokens", "4", "--device", "cuda")


def test_bench_compares_variants(tmp_path):
    variants = {"heads only": {"lookup": 0}, "lookup 6": {"lookup": 6},
                "dynamic": {"tree": {"depth": 2, "width": 2, "nodes": 5}}}
    out = _bench(tmp_path, "abc abc abc abc\nsecond prompt\n", "--max-new-tokens", "24",
                 "--variants", json.dumps(variants), "--no-prompt-lookup")
    results = json.loads((out / "results.json").read_text())
    assert list(results) == ["plain generate", "clover, one-token steps", "clover (heads only)", "clover (lookup 6)",
                             "clover (dynamic)"]  # variants are measured against Clover's one-token steps too
    for name in ("clover (heads only)", "clover (lookup 6)", "clover (dynamic)"):
        assert results[name]["identical"] == 2 and results[name]["new_tokens"] == 48
    text = (out / "results.md").read_text()
    assert "| clover (lookup 6) |" in text and "accept d6" in text
    assert "clover (lookup 6) step:" in text


def test_bench_sampling_runs_clover_and_marks_identity_not_applicable(tmp_path):
    out = _bench(tmp_path, "first prompt\n", "--max-new-tokens", "10", "--do-sample", "--temperature", "0.8",
                 "--no-prompt-lookup")
    results = json.loads((out / "results.json").read_text())
    clover = results["clover"]
    assert clover["new_tokens"] == 10 and len(clover["accepted_lengths"]) == clover["steps"] - 1  # Clover ran, no fallback
    text = (out / "results.md").read_text()
    assert "sampling (temperature 0.8)" in text
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in rows[0]]
    column = header.index("identical to plain")
    cells = {r[0].strip(): r[column].strip() for r in rows[1:]}
    assert cells["clover"] == "-" and cells["plain generate"] == "-"  # sampled outputs are not compared


def test_bench_batches_prompts(tmp_path):
    """`--batch-size 2`: prompts run as left-padded batches; rows are compared one by one, and prompt
    lookup (one sequence at a time in transformers) is left out."""
    out = _bench(tmp_path, "first prompt\nthe second prompt is longer\nthird\n", "--max-new-tokens", "8",
                 "--batch-size", "2")
    text = (out / "results.md").read_text()
    assert "3 prompts" in text and "batch 2" in text and "prompt lookup" not in text
    results = json.loads((out / "results.json").read_text())
    clover = results["clover"]
    assert clover["prompts"] == 3 and clover["new_tokens"] == 24 and clover["identical"] == 3
    assert results["plain generate"]["steps"] == 16  # two batches of 8 forwards each


def test_prompts_below_the_threshold_are_timed_again():
    _, tok, clover = _tiny_clover()
    results = run_benchmark(clover, tok, ["hello", "a longer prompt here"], max_new_tokens=6, warmup=0,
                            prompt_lookup=False, recheck=2, recheck_below=100.0, log=lambda *_: None)
    for r in results.values():  # every prompt was "slow": each method timed 1 + 2 times on each
        assert sorted(r.rechecked) == [0, 1] and all(len(v) == 3 for v in r.rechecked.values())
        assert all(v[0] == rate for v, rate in zip(r.rechecked.values(), r.prompt_rates))
    assert "timed 3 times each (median)" in slowest_prompts(results)


def test_slowest_prompts_reports_the_first_timing_and_the_median_of_rechecks():
    plain = MethodResult("plain generate", prompt_rates=[10.0, 10.0, 10.0], rechecked={1: [10.0, 9.0, 11.0]})
    clover = MethodResult("clover", prompt_rates=[12.0, 7.0, 9.5], rechecked={1: [7.0, 10.0, 10.5]})
    lines = slowest_prompts({"plain generate": plain, "clover": clover}).splitlines()
    assert lines[0] == "clover: slowest prompt 0.70x plain (prompt 2), 1 of 3 prompts below 0.9x"
    assert lines[1] == ("clover, the 1 prompt below 0.9x of any method timed 3 times each (median): "
                        "slowest prompt 0.95x plain (prompt 3), 0 of 3 prompts below 0.9x")
    assert lines[2] == "plain generate on those prompts: its own fastest and slowest timing differ by up to 1.22x"


def test_slowest_prompts_name_outputs_of_another_length():
    """A shorter output shares the prefill among fewer tokens: the report says so beside the ratio."""
    plain = MethodResult("plain generate", prompt_rates=[10.0, 10.0, 10.0], prompt_tokens=[128, 128, 128])
    clover = MethodResult("clover", prompt_rates=[5.0, 8.5, 12.0], prompt_tokens=[20, 128, 128])
    line = slowest_prompts({"plain generate": plain, "clover": clover})
    assert line == ("clover: slowest prompt 0.50x plain (prompt 1: 20 new tokens against plain's 128), "
                    "2 of 3 prompts below 0.9x (1 of them with an output of another length than plain's)")


def test_outputs_of_another_length_are_compared_with_plain_made_to_produce_as_many_tokens():
    """A method that stops early is timed against plain `generate` producing exactly that many tokens."""
    base, tok, clover = _tiny_clover()
    plain_lengths = []
    generate = base.generate

    def recording_generate(*args, **kwargs):
        if "min_new_tokens" in kwargs:
            plain_lengths.append((kwargs["min_new_tokens"], kwargs["max_new_tokens"]))
        return generate(*args, **kwargs)

    base.generate = recording_generate

    class StopsEarly:  # a drafting method whose output is shorter than plain's
        generation_stats = None

        def generate(self, max_new_tokens, clover_profile, **kwargs):
            return clover.generate(max_new_tokens=4, **kwargs)

    results = run_benchmark(clover, tok, ["hello", "a longer prompt here"], max_new_tokens=8, warmup=0,
                            prompt_lookup=False, baselines={"short": StopsEarly()}, recheck=2,
                            recheck_below=100.0, log=lambda *_: None)
    short, plain = results["short"], results["plain generate"]
    assert short.prompt_tokens == [4, 4] and plain.prompt_tokens == [8, 8]
    assert sorted(short.same_length) == [0, 1] and not results["clover"].same_length
    assert all(len(v) == 3 for v in short.same_length.values())  # the first timing and 2 rechecks
    assert plain_lengths == [(4, 4)] * 6
    k = 1
    assert short.ratio(plain, k) == pytest.approx(
        sorted(short.rechecked[k])[1] / sorted(short.same_length[k])[1])
    assert "compared with plain made to produce 4" in slowest_prompts(results)


def test_ratio_uses_the_same_length_reference_where_there_is_one():
    plain = MethodResult("plain generate", prompt_rates=[10.0, 10.0], prompt_tokens=[128, 128])
    clover = MethodResult("clover", prompt_rates=[5.0, 12.0], prompt_tokens=[20, 128], same_length={0: [4.0]})
    assert clover.ratio(plain, 0) == 1.25 and clover.ratio(plain, 1) == 1.2
    assert slowest_prompts({"plain generate": plain, "clover": clover}) == (
        "clover: slowest prompt 1.20x plain (prompt 2), 0 of 2 prompts below 0.9x")


def test_a_longer_output_than_plain_s_is_compared_with_plain_kept_from_stopping():
    """Plain stops at its end-of-sequence token; a method that runs on is compared with plain made to
    produce as many tokens (its end-of-sequence token held back until then)."""
    base, tok, clover = _tiny_clover()
    prompts = ["hello"]
    ids = encode_batches(tok, prompts, 1, "cpu")[0]["input_ids"]  # as the bench encodes it
    eos = int(base.generate(ids, max_new_tokens=3, do_sample=False)[0, -1])  # plain's third token
    base.generation_config.eos_token_id = eos
    forced = []
    generate = base.generate

    def recording_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        if "min_new_tokens" in kwargs:
            forced.append((kwargs["min_new_tokens"], out.shape[1] - kwargs["input_ids"].shape[1]))
        return out

    base.generate = recording_generate

    class RunsOn:  # a drafting method that does not stop at the end-of-sequence token
        generation_stats = None

        def generate(self, max_new_tokens, clover_profile, **kwargs):
            return generate(**kwargs, max_new_tokens=max_new_tokens, suppress_tokens=[eos])

    results = run_benchmark(clover, tok, prompts, max_new_tokens=8, warmup=0, prompt_lookup=False,
                            baselines={"runs on": RunsOn()}, log=lambda *_: None)
    plain, runs_on = results["plain generate"], results["runs on"]
    assert plain.prompt_tokens[0] <= 3 and runs_on.prompt_tokens == [8]
    assert forced == [(8, 8)] and list(runs_on.same_length) == [0]
    assert runs_on.ratio(plain, 0) == runs_on.prompt_rates[0] / runs_on.same_length[0][0]


def test_the_long_prompts_example_writes_prompts_the_bench_reads(tmp_path, monkeypatch, capsys):
    """`examples/long_prompts.py` prints long ShareGPT conversations, each cut to --chars and asking for a summary,
    as .jsonl that `--prompts` reads back."""
    path = Path(__file__).resolve().parents[1] / "examples" / "long_prompts.py"
    spec = importlib.util.spec_from_file_location("long_prompts", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(sys, "argv", ["long_prompts.py", "--count", "3", "--chars", "4000"])
    example.main()
    out = tmp_path / "long.jsonl"
    out.write_text(capsys.readouterr().out)
    prompts = read_prompts(str(out), None)
    assert len(prompts) == 3 and len(set(prompts)) == 3
    for prompt in prompts:
        assert prompt.startswith("Read this conversation:\n\n") and prompt.endswith(example.ASK)
        assert len(prompt) == len("Read this conversation:\n\n") + 4000 + len(example.ASK)


def test_prompts_of_a_tokenizer_without_a_chat_template_are_encoded_as_plain_text():
    """A base model's tokenizer has no chat template: the bench (and `examples/first_call.py --base`) takes its
    prompts as plain text, one row each, or left-padded batches with their attention mask."""
    tok = byte_tokenizer()
    tok.pad_token = tok.convert_ids_to_tokens(0)
    (one,) = encode_batches(tok, ["abc"], 1, "cpu")
    assert one["input_ids"].tolist() == [[97, 98, 99]]
    (both,) = encode_batches(tok, ["abc", "a"], 2, "cpu")
    assert both["input_ids"].tolist() == [[97, 98, 99], [0, 0, 97]]
    assert both["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
