"""Speed benchmark: plain `generate`, Clover, the Medusa baseline and prompt-lookup decoding,
interleaved prompt by prompt.

Every method runs on the same prompts in the same process, so ratios are measured side by side.
"""

from __future__ import annotations

import json
import resource
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from clover_hf.base.verify_forward import BUCKETS
from clover_hf.core.hardware import timed
from clover_hf.training.data import mtbench_questions


@dataclass
class MethodResult:
    name: str
    seconds: float = 0.0
    new_tokens: int = 0
    steps: int = 0
    verify_steps: int = 0  # Clover's forwards after the prefill: the steps that draft and verify
    verified_tokens: int = 0  # tokens verified over all verify steps and rows (the root included)
    head_drafts: int = 0  # verify steps whose tree the heads drafted
    identical: int = 0
    prompts: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    prompt_rates: list[float] = field(default_factory=list)  # tokens/s on each prompt (or batch)
    prompt_tokens: list[int] = field(default_factory=list)  # new tokens on each prompt (or batch)
    rechecked: dict[int, list[float]] = field(default_factory=dict)  # prompt -> its tokens/s, every time measured
    # prompt -> plain `generate`'s tokens/s (every time measured) made to produce as many tokens as this method
    # did there, where that differs from plain's own output length (batch size 1)
    same_length: dict[int, list[float]] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.steps if self.steps else float("nan")

    @property
    def verified_per_step(self) -> float:
        """Tokens verified per verify step and row: the budget the method chose (1 = plain decoding)."""
        n = len(self.accepted_lengths)
        return self.verified_tokens / n if n else float("nan")

    def ratio(self, plain: "MethodResult", k: int, first: bool = False) -> float:
        """Speed on prompt k relative to plain `generate`, median against median of their timings
        (`first`: the first timing of each). Where the output lengths differ, the reference is plain
        made to produce as many tokens: a shorter output shares the prefill among fewer tokens."""
        pick = (lambda timings: timings[0]) if first else statistics.median
        own = pick(self.rechecked[k]) if k in self.rechecked else self.prompt_rates[k]
        if k in self.same_length:
            reference = pick(self.same_length[k])
        else:
            reference = pick(plain.rechecked[k]) if k in plain.rechecked else plain.prompt_rates[k]
        return own / reference

    def add(self, out: torch.Tensor, tokens: int, seconds: float, stats, prompt_len: int) -> None:
        """One timing on a prompt (or batch): its output, new tokens and seconds, and a drafting method's
        `GenerationStats` (None for the others)."""
        self.seconds += seconds
        self.new_tokens += tokens
        self.prompt_rates.append(tokens / seconds)
        self.prompt_tokens.append(tokens)
        self.prompts += out.shape[0]
        if stats is not None:
            self.steps += stats.steps
            self.verify_steps += stats.steps - 1
            self.accepted_lengths += stats.accepted_lengths
            self.verified_tokens += stats.verified_tokens
            self.head_drafts += stats.head_drafts
            for stage, sec in stats.stage_seconds.items():
                self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + sec
        elif self.name == "plain generate":
            self.steps += out.shape[1] - prompt_len

    def acceptance_by_depth(self, max_depth: int) -> list[float]:
        """Share of verify steps (of rows, in a batch) that accepted at least d drafted tokens, d = 1..max_depth."""
        n = len(self.accepted_lengths)
        return [sum(a >= d for a in self.accepted_lengths) / n if n else float("nan") for d in range(1, max_depth + 1)]


ONE_TOKEN = "clover, one-token steps"  # Clover's kernels without speculation: what "clover" is measured against too
DEFAULT_RUNS = {ONE_TOKEN: {"budget": "one-token"}, "clover": {}}
STATIC = "static+compiled"  # the suffix of runs on a static cache with a compiled forward
WARM_CALLS = 8  # warm-up calls of each Clover run at most, until one learns nothing of how the machine multiplies
PLAIN_STATIC, CLOVER_STATIC = f"plain generate, {STATIC}", f"clover, {STATIC}"


def static_runs(device: torch.device) -> tuple[dict[str, dict], dict[str, dict]]:
    """Plain `generate` and Clover on a static cache with a compiled forward, as transformers compiles it
    (its default `CompileConfig`: CUDA graphs on a GPU; on a CPU, where transformers does not compile by
    default, with its `_compile_all_devices` switch): (plain runs, Clover runs) for `run_benchmark`."""
    from transformers import CompileConfig

    config = CompileConfig()
    if device.type not in ("cuda", "xpu"):
        config._compile_all_devices = True
    kwargs = {"cache_implementation": "static", "compile_config": config}
    return {PLAIN_STATIC: kwargs}, {CLOVER_STATIC: kwargs}


def read_prompts(source: str | None, limit: int | None) -> list[str]:
    """MT-Bench first turns by default; else a .jsonl ("prompt" or "turns") or a text file (one per line)."""
    if source in (None, "mtbench"):
        prompts = mtbench_questions(1)
    else:
        path = Path(source)
        if path.suffix == ".jsonl":
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            prompts = [r["prompt"] if "prompt" in r else r["turns"][0] for r in rows]
        else:
            prompts = [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {source}")
    return prompts[:limit] if limit else prompts


def _generated_lengths(out: torch.Tensor, prompt_len: int, eos: set[int]) -> list[int]:
    """Tokens each row generated: up to and including its first end-of-sequence token (the rest is padding)."""
    lengths = []
    for row in out[:, prompt_len:].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        lengths.append(ends[0] + 1 if ends else len(row))
    return lengths


def encode_batches(tokenizer, prompts: list[str], batch_size: int, device) -> list[dict[str, torch.Tensor]]:
    """Chat-formatted prompts as `generate` inputs (plain text where the tokenizer has no chat template, as a base
    model's); batches are left-padded with their attention mask."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    chats = [[{"role": "user", "content": p}] for p in prompts]
    if batch_size == 1 and chat:
        return [{"input_ids": tokenizer.apply_chat_template(c, add_generation_prompt=True, return_tensors="pt",
                                                            return_dict=False).to(device)} for c in chats]
    if batch_size > 1 and tokenizer.pad_token is None:
        raise ValueError("batched benchmarks pad prompts: the tokenizer needs a pad_token")
    tokenizer.padding_side = "left"
    texts = prompts  # plain text: the tokenizer adds its special tokens (a BOS), as to any prompt
    if chat:
        texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    return [dict(tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=batch_size > 1,
                           add_special_tokens=not chat).to(device))
            for i in range(0, len(texts), batch_size)]


def run_benchmark(model, tokenizer, prompts: list[str], max_new_tokens: int = 128, do_sample: bool = False,
                  prompt_lookup: bool = True, warmup: int = 1, profile: bool | None = None,
                  clover_runs: dict[str, dict] | None = None, temperature: float | None = None,
                  batch_size: int = 1, baselines: dict[str, object] | None = None, recheck: int = 0,
                  recheck_below: float = 0.9, plain_runs: dict[str, dict] | None = None,
                  log=print) -> dict[str, MethodResult]:
    """Interleave the methods on each prompt (or batch of prompts); plain `generate` is the reference
    for identity and speed. The first `warmup` batches run untimed, each Clover run again (up to WARM_CALLS) until
    a call learns nothing of how this machine multiplies: the figures are of warm calls (`examples/first_call.py`
    times first ones).

    With `do_sample` every method draws from the same seed per prompt, but each consumes random
    numbers differently, so identical outputs are not expected (the table shows "-").

    `clover_runs` names Clover variants and their extra `generate` arguments (default: `DEFAULT_RUNS`,
    Clover with the heads' own settings and Clover's kernels with one-token steps, so that what
    speculation adds shows apart from what the kernels do). `baselines` names other heads on the same base, as `CloverForCausalLM`s
    (the Medusa baseline), each run with its own settings. `profile` times Clover's stages; it syncs
    the device at each stage, which is free only on CPU, so by default it is on there alone. With
    `batch_size` > 1 prompts run in left-padded batches; transformers' prompt lookup decodes one
    sequence at a time, so it is left out; tokens/step counts the tokens of all rows per forward.
    `plain_runs` names more runs of plain `generate` with extra arguments (a static cache, compiled).

    One timing of a prompt on a shared machine is noisy, so a prompt on which a method ran
    below `recheck_below` times plain `generate` is timed `recheck` more times, all methods interleaved;
    `slowest_prompts` then reports the median of its timings next to the first one. Where a method's
    output has another length than plain's (batch size 1), plain is also timed producing that many
    tokens, with each of that method's timings, and the prompt's ratio is taken against it (one more
    plain run per such timing: under sampling, most prompts).
    """
    base = model.base_model
    profile = base.device.type == "cpu" if profile is None else profile
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample)
    if do_sample and temperature is not None:
        kwargs["temperature"] = temperature
    clover_runs, plain_runs = clover_runs or DEFAULT_RUNS, plain_runs or {}
    drafting = {name: (model, extra) for name, extra in clover_runs.items()}
    drafting |= {name: (other, {}) for name, other in (baselines or {}).items()}
    methods = _methods(base, kwargs, plain_runs, drafting, profile, prompt_lookup and batch_size == 1)
    results = {name: MethodResult(name) for name in methods}
    timer = _Timer(base, encode_batches(tokenizer, prompts, batch_size, base.device), kwargs)
    _fit_static_caches(timer.batches, max_new_tokens, [*plain_runs.values(), *clover_runs.values()])
    for inputs in timer.batches[:warmup]:
        for name, fn in methods.items():
            # a Clover run again until a call learns nothing: a first call learns only what it can pay for
            for _ in range(WARM_CALLS if name in drafting else 1):
                fn(inputs)
                stats = getattr(drafting[name][0], "generation_stats", None) if name in drafting else None
                if stats is None or not stats.learning_steps:
                    break
    for k in range(len(timer.batches)):
        _time_batch(timer, k, methods, drafting, results, same_length=batch_size == 1)
        log(f"[{k + 1}/{len(timer.batches)}] " + "  ".join(
            f"{n}: {r.tokens_per_second:.1f} tok/s" for n, r in results.items()))
    if recheck:
        _recheck(timer, methods, results, recheck, recheck_below, log)
    return results


def _methods(base, kwargs: dict, plain_runs: dict[str, dict], drafting: dict[str, tuple], profile: bool,
             prompt_lookup: bool) -> dict[str, Callable]:
    """Each method by name, as a function of a batch's `generate` inputs: plain `generate` first (the reference),
    its `plain_runs`, the `drafting` runs (name -> (model, extra arguments)), and prompt lookup decoding."""
    methods = {"plain generate": lambda inputs: base.generate(**inputs, **kwargs)}
    for name, extra in plain_runs.items():
        methods[name] = lambda inputs, extra=extra: base.generate(**inputs, **extra, **kwargs)
    for name, (drafter, extra) in drafting.items():
        methods[name] = lambda inputs, drafter=drafter, extra=extra: drafter.generate(
            **inputs, clover_profile=profile, **extra, **kwargs)
    if prompt_lookup:
        methods["prompt lookup (10)"] = lambda inputs: base.generate(**inputs, prompt_lookup_num_tokens=10, **kwargs)
    return methods


def _fit_static_caches(batches: list[dict[str, torch.Tensor]], max_new_tokens: int, runs: list[dict]) -> None:
    """One static cache size for every prompt (as transformers advises for compiled decoding), with room for
    Clover's widest tree: a cache that grew with a longer prompt would compile again inside a timing."""
    slots = max(b["input_ids"].shape[1] for b in batches) + max_new_tokens + BUCKETS[-1]
    for extra in runs:
        if extra.get("cache_implementation") == "static":
            extra.setdefault("max_cache_len", slots)


class _Timer:
    """Times one method on one batch of the benchmark, seeded by the batch's index."""

    def __init__(self, base, batches: list[dict[str, torch.Tensor]], kwargs: dict) -> None:
        self.base, self.batches, self.kwargs = base, batches, kwargs
        eos = base.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def run(self, fn: Callable, k: int) -> tuple[torch.Tensor, int, float]:
        """`fn` on batch k, seeded by k: its output, new tokens and seconds."""
        torch.manual_seed(k)
        out, seconds = timed(lambda: fn(self.batches[k]), self.base.device)
        return out, sum(_generated_lengths(out, self.batches[k]["input_ids"].shape[1], self.eos)), seconds

    def plain_rate(self, k: int, n: int) -> float:
        """Tokens/s of plain `generate` on batch k made to produce exactly n new tokens."""
        _, tokens, seconds = self.run(lambda inputs: self.base.generate(
            **inputs, **{**self.kwargs, "max_new_tokens": n, "min_new_tokens": n}), k)
        return tokens / seconds


def _time_batch(timer: _Timer, k: int, methods: dict[str, Callable], drafting: dict[str, tuple],
                results: dict[str, MethodResult], same_length: bool) -> None:
    """Every method once on batch k, plain `generate` first: its timing, steps, and how many rows match plain's
    output; with `same_length` (batch size 1), plain also made to produce as many tokens as each method whose
    output has another length."""
    prompt_len = timer.batches[k]["input_ids"].shape[1]
    reference = None
    for name, fn in methods.items():
        out, tokens, seconds = timer.run(fn, k)
        r = results[name]
        r.add(out, tokens, seconds, drafting[name][0].generation_stats if name in drafting else None, prompt_len)
        if reference is None:
            reference = out
        if out.shape == reference.shape:
            r.identical += int((out == reference).all(dim=1).sum())
    if same_length:
        plain = results["plain generate"]
        for r in results.values():
            if r.prompt_tokens[k] != plain.prompt_tokens[k]:
                r.same_length[k] = [timer.plain_rate(k, r.prompt_tokens[k])]


def _recheck(timer: _Timer, methods: dict[str, Callable], results: dict[str, MethodResult], times: int,
             below: float, log) -> None:
    """Time each prompt on which any method ran below `below` times plain `generate` `times` more times, all
    methods interleaved (and plain made to produce as many tokens where a method's output length differs)."""
    plain = results["plain generate"]
    slow = sorted({k for r in results.values() for k in range(len(timer.batches)) if r.ratio(plain, k) < below})
    for k in slow:
        for r in results.values():
            r.rechecked[k] = [r.prompt_rates[k]]
        for _ in range(times):
            for name, fn in methods.items():
                _, tokens, seconds = timer.run(fn, k)
                results[name].rechecked[k].append(tokens / seconds)
                if k in results[name].same_length:
                    results[name].same_length[k].append(timer.plain_rate(k, tokens))
        log(f"[recheck {k + 1}] " + "  ".join(f"{n}: {statistics.median(r.rechecked[k]):.1f} tok/s" for n, r in results.items()))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory(device: torch.device) -> str:
    """The process's peak RSS, and on CUDA the peak memory torch allocated on the device."""
    text = f"process peak RSS {peak_rss_mib():.0f} MiB"
    if device.type == "cuda":
        text += f", peak CUDA memory allocated {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB"
    return text


def markdown_table(results: dict[str, MethodResult], max_depth: int, sampled: bool = False) -> str:
    plain = results["plain generate"]
    head = ["method", "tokens/s", "x plain", "tokens/step", "verified/step", "heads drafted", "identical to plain"]
    head += [f"accept d{d}" for d in range(1, max_depth + 1)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results.values():
        acc = r.acceptance_by_depth(max_depth) if r.accepted_lengths else [float("nan")] * max_depth
        cells = [r.name, f"{r.tokens_per_second:.1f}", f"{r.tokens_per_second / plain.tokens_per_second:.2f}",
                 f"{r.tokens_per_step:.2f}" if r.steps else "-",
                 f"{r.verified_per_step:.2f}" if r.accepted_lengths else "-",
                 f"{r.head_drafts / r.verify_steps:.0%}" if r.accepted_lengths and r.verify_steps else "-",
                 "-" if sampled else f"{r.identical}/{r.prompts}"]
        cells += ["-" if a != a else f"{a:.2f}" for a in acc]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def slowest_prompts(results: dict[str, MethodResult]) -> str:
    """Per method, its lowest speed relative to plain `generate` on one prompt (or batch), and on how
    many prompts it was below 0.9x.

    Where a method's output has another length than plain's (bf16 rounding, sampling), the prefill is
    shared by other numbers of tokens: the ratio is then against plain made to produce as many tokens
    where the run timed that (batch size 1), and such prompts are named."""
    base = results["plain generate"]
    lines = []
    for r in results.values():
        if r.name == "plain generate" or not r.prompt_rates:
            continue
        ratios = [r.ratio(base, k, first=True) for k in range(len(r.prompt_rates))]
        lines.append(f"{r.name}: {_ratio_summary(r, base, ratios)}")
        if r.rechecked:
            ratios = [r.ratio(base, k) for k in range(len(r.prompt_rates))]
            times = len(next(iter(r.rechecked.values())))
            count = "the 1 prompt" if len(r.rechecked) == 1 else f"the {len(r.rechecked)} prompts"
            lines.append(f"{r.name}, {count} below 0.9x of any method timed {times} times each "
                         f"(median): {_ratio_summary(r, base, ratios)}")
    if base.rechecked:
        spread = max(max(v) / min(v) for v in base.rechecked.values())
        lines.append(f"plain generate on those prompts: its own fastest and slowest timing differ by up to {spread:.2f}x")
    return "\n".join(lines)


def _ratio_summary(r: MethodResult, base: MethodResult, ratios: list[float]) -> str:
    """"slowest prompt 0.80x plain (prompt k), n of N prompts below 0.9x", naming outputs of another
    length than plain's (per-prompt token counts are known only for runs that recorded them)."""
    def other_length(k: int) -> bool:
        return k < min(len(r.prompt_tokens), len(base.prompt_tokens)) and r.prompt_tokens[k] != base.prompt_tokens[k]

    k = ratios.index(min(ratios))
    where = f"prompt {k + 1}"
    if other_length(k):
        where += f": {r.prompt_tokens[k]} new tokens against plain's {base.prompt_tokens[k]}"
        if k in r.same_length:
            where += f", compared with plain made to produce {r.prompt_tokens[k]}"
    slow = [j for j, x in enumerate(ratios) if x < 0.9]
    text = f"slowest prompt {min(ratios):.2f}x plain ({where}), {len(slow)} of {len(ratios)} prompts below 0.9x"
    other = sum(other_length(j) for j in slow)
    return text + (f" ({other} of them with an output of another length than plain's)" if other else "")


def speculation_shares(results: dict[str, MethodResult]) -> str:
    """Each Clover run's speed against Clover's own one-token steps (the same kernels, no drafting): what
    speculation adds, apart from the kernels' gain over plain `generate`."""
    one = next((r for r in results.values() if r.name == ONE_TOKEN or r.name.endswith("(one-token)")), None)
    if one is None or not one.tokens_per_second:
        return ""
    plain = results["plain generate"].tokens_per_second
    lines = [f"Clover's kernels alone (one-token steps): {one.tokens_per_second / plain:.2f}x plain generate"]
    for r in results.values():
        if r is not one and r.name != "plain generate" and r.accepted_lengths and not r.name.endswith(STATIC):
            lines.append(f"what speculation adds: {r.name} {r.tokens_per_second / one.tokens_per_second:.2f}x "
                         f"its one-token steps ({r.tokens_per_second / plain:.2f}x plain)")
    return "\n".join(lines)


def static_shares(results: dict[str, MethodResult]) -> str:
    """Clover on a static cache with a compiled forward against plain `generate` on the same cache, compiled
    the same way: what Clover adds where a user already compiles."""
    plain, clover = results.get(PLAIN_STATIC), results.get(CLOVER_STATIC)
    if plain is None or clover is None or not plain.tokens_per_second:
        return ""
    eager = results["plain generate"].tokens_per_second
    return (f"{STATIC}: plain generate {plain.tokens_per_second / eager:.2f}x eager plain generate; "
            f"clover {clover.tokens_per_second / plain.tokens_per_second:.2f}x plain generate {STATIC} "
            f"({clover.tokens_per_second / eager:.2f}x eager plain)")


def step_breakdown(result: MethodResult) -> str:
    """Mean milliseconds per verify step by stage, and how much of a step the verify forward is."""
    steps = result.verify_steps
    if not steps or not result.stage_seconds:
        return ""
    total = sum(result.stage_seconds.values())
    parts = ", ".join(f"{k} {1000 * v / steps:.1f} ms" for k, v in result.stage_seconds.items())
    verify = result.stage_seconds.get("verify forward", 0.0)
    return (f"{result.name} step: {1000 * total / steps:.1f} ms ({parts}); the verify forward is "
            f"{100 * verify / total:.0f}% of a step, so a step costs {total / verify:.2f}x one verify forward")


def plot(results: dict[str, MethodResult], path: str | Path) -> Path | None:
    """Speedup bars and the accepted-length histogram as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    plain = results["plain generate"].tokens_per_second
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(results)
    a.bar(names, [results[n].tokens_per_second / plain for n in names])
    a.axhline(1.0, color="k", lw=0.8)
    a.set_ylabel("speedup over plain generate")
    a.tick_params(axis="x", labelrotation=20)
    drafted = [r for r in results.values() if r.accepted_lengths]
    longest = max((max(r.accepted_lengths) for r in drafted), default=0)  # lookup chains run past the heads
    b.hist([r.accepted_lengths for r in drafted], bins=range(longest + 2), align="left", label=[r.name for r in drafted])
    b.legend()
    b.set_xlabel("drafted tokens accepted per step")
    b.set_ylabel("steps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
