"""`clover-hf` command line.

Examples:
    # heads for your model, on ShareGPT prompts answered by the model itself
    clover-hf train --base-model HuggingFaceTB/SmolLM2-135M-Instruct --self-distill --output-dir runs/smol

    # your own chat data (JSONL with "messages"), several processes or GPUs
    accelerate launch --num_processes 2 -m clover_hf.cli train --base-model ./my-model \\
        --data chats.jsonl --output-dir runs/mine --max-steps 2000

    # an interrupted run resumes from its last checkpoint when started again with the same command

    # training data at scale: prompts answered by Clover, features written as it generates (resumable), then
    # heads trained on them
    clover-hf distill --max-records 20000 --max-minutes 120
    clover-hf train --base-model HuggingFaceTB/SmolLM2-135M-Instruct --features ~/.cache/clover_hf/distill/... \
        --output-dir runs/smol

    # Medusa heads for vLLM's Medusa draft model
    clover-hf export runs/medusa/heads vllm-medusa --format vllm-medusa

    # Clover for code that keeps its AutoModelForCausalLM: a custom_generate repo on the Hub
    clover-hf export-generate clover-generate --push-to-hub your-org/clover

    # speed on the embedded SmolLM2 with the shipped heads: plain generate vs Clover vs Medusa vs prompt lookup
    clover-hf bench --dtype bfloat16 --limit 80 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

DEBUG_ENV = "CLOVER_HF_DEBUG"  # set to 1 for the traceback of every error, as --debug does
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_imports() -> None:
    """Quiet third-party loggers that print as they are imported, whatever the program does (torchao 0.18 with
    a CPU build of torch: its CUDA kernels fail to load). For programs, before they import transformers."""
    import logging

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def _add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        help_text = f.metadata.get("help", "")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        base = args[0] if args else kind
        if typing.get_origin(base) in (list, tuple) or typing.get_origin(kind) in (list, tuple):
            inner = typing.get_args(base if typing.get_origin(base) else kind)[0]
            parser.add_argument(flag, type=inner, nargs="+", default=default, required=required, help=help_text)
        else:
            parser.add_argument(flag, type=base, default=default, required=required,
                                help=f"{help_text} (default: {default})")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors take one line: the usage of `train` alone runs to 35."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def make_parser() -> argparse.ArgumentParser:
    from clover_hf.training.pipeline import DataConfig
    from clover_hf.training.trainer import TrainConfig

    parser = _Parser(prog="clover-hf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help=f"show the traceback of an error instead of one line (or set {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train Clover heads for a base model", parents=[common])
    _add_dataclass_args(train, DataConfig)
    _add_dataclass_args(train, TrainConfig)
    train.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="upload the trained heads to this repo")

    distill = sub.add_parser("distill", help="answer prompts with Clover and write their features for training (resumable)",
                             parents=[common])
    distill.add_argument("--heads", default=None, help="heads dir or repo (default: the shipped SmolLM2 heads)")
    distill.add_argument("--base-model", default=None, help="base model (default: the heads' base, or embedded SmolLM2)")
    distill.add_argument("--data", nargs="+", default=None, help="chat data files, or 'sharegpt' (default)")
    distill.add_argument("--max-records", type=int, default=None, help="answer at most this many prompts")
    distill.add_argument("--skip-records", type=int, default=0, help="skip this many records first")
    distill.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    distill.add_argument("--top-k", type=int, default=8, help="base next-token probabilities kept per position")
    distill.add_argument("--max-new-tokens", type=int, default=256)
    distill.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are left out")
    distill.add_argument("--batch-size", type=int, default=4, help="prompts answered together")
    distill.add_argument("--shard-tokens", type=int, default=200_000, help="tokens per shard written")
    distill.add_argument("--out", default=None, help="where the shards go (default: the user cache, named by the run)")
    distill.add_argument("--max-minutes", type=float, default=None,
                         help="stop after about this long (the same command goes on later)")

    engine = sub.add_parser("export", help="write heads in a serving engine's layout", parents=[common])
    engine.add_argument("heads", help="heads directory or repo (Medusa heads)")
    engine.add_argument("directory", help="where the engine's files go")
    engine.add_argument("--format", default="vllm-medusa", choices=["vllm-medusa"],
                        help="vllm-medusa: vLLM's Medusa draft model (speculative_config method 'medusa')")
    engine.add_argument("--base-model", default=None,
                        help="the base, for heads that draft through its lm_head (default: the one their config names)")

    export = sub.add_parser("export-generate", help="write a custom_generate repo: Clover for an unchanged model's generate",
                            parents=[common])
    export.add_argument("directory", help="where the repo's files go")
    export.add_argument("--repo-id", default=None, help="the repo's name on the Hub, for its README (default: --push-to-hub's)")
    export.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="also upload it to this repo")

    bench = sub.add_parser("bench", help="tokens/s of plain generate, Clover, Medusa and prompt lookup, side by side",
                           parents=[common])
    bench.add_argument("--heads", default=None, help="heads dir or repo (default: the shipped SmolLM2 heads)")
    bench.add_argument("--base-model", default=None, help="base model (default: the heads' base, or embedded SmolLM2)")
    bench.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    bench.add_argument("--quantize", default=None, choices=["int8", "int4"],
                       help="quantize the base's linear layers with torchao, weight-only, before timing")
    bench.add_argument("--prompts", default="mtbench", help="'mtbench' (first turns), a .jsonl or a text file")
    bench.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--do-sample", action="store_true", help="sampling instead of greedy")
    bench.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the model's)")
    bench.add_argument("--no-prompt-lookup", action="store_true", help="skip HF prompt-lookup decoding")
    bench.add_argument("--medusa-heads", default=None,
                       help="Medusa baseline heads (dir or repo) for the same base (default: the shipped ones, "
                            "when the shipped Clover heads are benchmarked)")
    bench.add_argument("--no-medusa", action="store_true", help="skip the Medusa baseline")
    bench.add_argument("--batch-size", type=int, default=1,
                       help="prompts per generate call, left-padded (prompt lookup runs only at batch 1)")
    bench.add_argument("--variants", default=None,
                       help='Clover variants to compare, as JSON: name -> generate arguments, e.g. '
                            '\'{"static": {"lookup": 0}, "dynamic": {"tree": {"depth": 4, "width": 4, "nodes": 16}}}\' '
                            "(default: one run with the heads' own settings)")
    bench.add_argument("--recheck", type=int, default=3,
                       help="time each prompt on which a method ran below 0.9x plain this many more times, "
                            "and report the median too (0: never)")
    bench.add_argument("--static", action=argparse.BooleanOptionalAction, default=None,
                       help="also run plain generate and Clover on a static cache with a compiled forward, as "
                            "transformers compiles it (CUDA graphs on a GPU; on a CPU with its _compile_all_devices); "
                            "default: on a GPU")
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    bench.add_argument("--device", default=None,
                       help="cpu, cuda, cuda:1, ... (default: the machine's accelerator if it has one, else cpu)")
    bench.add_argument("--out-dir", default="runs/bench", help="where results.md, results.json and plot.png go")
    return parser


def _pick(cls: type, values: dict) -> typing.Any:
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


def user_error(error: BaseException) -> str | None:
    """`error` in one line where it is the user's to fix: bad values, missing files, packages or Hub access,
    a base that does not fit in memory. None for anything else: a bug keeps its traceback."""
    import torch

    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
            isinstance(error, RuntimeError) and "can't allocate memory" in text):
        return (f"out of memory: the base does not fit ({text}). Use a smaller dtype (--base-dtype or --dtype "
                "bfloat16), a smaller --batch-size, or a machine with more memory")
    if type(error).__module__.split(".")[0] == "httpx":
        return f"cannot reach the Hub ({text}). Check the network, or pass local paths (HF_HUB_OFFLINE=1)"
    if isinstance(error, (ValueError, OSError, ImportError)):
        return text
    return None


def main(argv: list[str] | None = None) -> int:
    """Run a command. A user error prints `clover-hf: error: ...` and exits with 2, as argparse's do;
    `--debug` (or CLOVER_HF_DEBUG=1) shows its traceback instead."""
    import os

    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    if not debug:
        quiet_imports()
    parser = make_parser()
    args = vars(parser.parse_args(argv))
    args.pop("debug")
    try:
        return _run(args)
    except Exception as error:
        message = None if debug else user_error(error)
        if message is None:
            raise
        parser.exit(2, f"{parser.prog}: error: {message}\n")  # not parser.error: no "see --help" here


def _run(args: dict) -> int:
    from clover_hf.training.pipeline import DataConfig, train_heads
    from clover_hf.training.trainer import STOPPED_EXIT_CODE, TrainConfig

    command = args.pop("command")
    if command == "train":
        push = args.pop("push_to_hub")
        if train_heads(_pick(DataConfig, args), _pick(TrainConfig, args), push_to_hub=push) is None:
            return STOPPED_EXIT_CODE  # stopped at --max-minutes with a checkpoint
    elif command == "bench":
        bench_command(**args)
    elif command == "distill":
        from clover_hf.training.distill import run_distill

        run_distill(**args)
    elif command == "export-generate":
        export_generate_command(**args)
    elif command == "export":
        export_command(**args)
    return 0


def export_command(heads: str, directory: str, format: str, base_model: str | None) -> None:
    from clover_hf.hub.formats import export_vllm_medusa
    from clover_hf.hub.repo import load_heads, resolve_heads

    loaded = load_heads(resolve_heads(heads))
    lm_head = None
    if loaded.config.head_type == "medusa" and not loaded.config.own_lm_heads:
        from transformers import AutoModelForCausalLM

        name = base_model or loaded.config.base_model_name_or_path
        if name is None:
            raise ValueError(f"{heads} names no base model and draws on its lm_head: pass --base-model")
        lm_head = AutoModelForCausalLM.from_pretrained(name).get_output_embeddings()
    path = export_vllm_medusa(loaded, directory, lm_head)
    print(f"written to {path}: vLLM serves it as speculative_config={{'method': 'medusa', 'model': '{path}', "
          f"'num_speculative_tokens': {loaded.config.num_heads}}}")


def export_generate_command(directory: str, repo_id: str | None, push_to_hub: str | None) -> None:
    from huggingface_hub import create_repo, upload_folder

    from clover_hf.custom_generate import export_generate

    path = export_generate(directory, repo_id or push_to_hub or "your-org/clover")
    print(f"custom_generate repo written to {path}")
    if push_to_hub:
        create_repo(push_to_hub, exist_ok=True)
        upload_folder(repo_id=push_to_hub, folder_path=str(path), commit_message="Clover custom_generate")
        print(f"pushed to {push_to_hub}: model.generate(..., custom_generate={push_to_hub!r}, "
              "trust_remote_code=True, clover_heads=...)")


def bench_command(heads, base_model, dtype, quantize, prompts, limit, max_new_tokens, do_sample, temperature,
                  no_prompt_lookup, medusa_heads, no_medusa, batch_size, variants, recheck, threads, device, out_dir,
                  static=None) -> None:
    import json
    from pathlib import Path

    import torch
    from transformers import AutoTokenizer

    from clover_hf import embedded
    from clover_hf.core.hardware import describe_machine
    from clover_hf.core.quantized import nbytes, quantization, quantize_base
    from clover_hf.hub.card import tree_summary
    from clover_hf.modeling import CloverForCausalLM
    from clover_hf.tools import bench

    if threads:
        torch.set_num_threads(threads)
    if not device:  # a CUDA build of torch on a machine without a GPU still names CUDA as its accelerator
        device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else "cpu"
    device = torch.device(device)
    torch_dtype = getattr(torch, dtype)
    shipped = heads is None
    heads, base_model = embedded.heads_and_base(heads, base_model, torch_dtype)
    model = CloverForCausalLM.from_pretrained(heads, base_model=base_model, dtype=torch_dtype).to(device).eval()
    if quantize:
        quantize_base(model.base_model, quantize)
    tokenizer = AutoTokenizer.from_pretrained(base_model or model.clover_config.base_model_name_or_path)
    texts = bench.read_prompts(prompts, limit)
    baselines: dict[str, CloverForCausalLM] = {}
    if not no_medusa and (medusa_heads or shipped):
        medusa = _medusa_baseline(model, medusa_heads)
        if medusa is not None:
            baselines["medusa"] = medusa
    runs = {f"clover ({name})": kwargs for name, kwargs in json.loads(variants).items()} if variants else None
    if runs and not any(kw.get("budget") == "one-token" for kw in runs.values()):
        runs = {bench.ONE_TOKEN: {"budget": "one-token"}, **runs}  # what speculation adds is measured against it
    plain_runs = None
    if static or (static is None and device.type in ("cuda", "xpu")):
        plain_runs, clover_static = bench.static_runs(device)
        runs = {**(runs or bench.DEFAULT_RUNS), **clover_static}
    results = bench.run_benchmark(model, tokenizer, texts, max_new_tokens, do_sample, not no_prompt_lookup,
                                  clover_runs=runs, temperature=temperature, batch_size=batch_size,
                                  baselines=baselines, recheck=recheck, plain_runs=plain_runs)
    # the table's "accept dN" columns reach as deep as any method drafts: its heads or its lookup chain
    reach = [model.clover_config.num_heads, model.clover_config.lookup_tokens,
             *(kw.get("lookup") or 0 for kw in (runs or {}).values())]
    reach += [n for other in baselines.values() for n in (other.clover_config.num_heads, other.clover_config.lookup_tokens)]
    depth = max(reach)
    breakdown = "\n\n".join(filter(None, (bench.step_breakdown(r) for r in results.values())))
    table = bench.markdown_table(results, depth, sampled=do_sample)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base_mib = sum(nbytes(p) for p in model.base_model.parameters()) / 2**20
    heads_mib = sum(t.numel() * t.element_size() for t in model.clover_heads.state_dict().values()) / 2**20
    quantized = f" quantized by {quantization(model.base_model)}" if quantize else ""
    summary = (f"{len(texts)} prompts ({prompts}), {max_new_tokens} new tokens, {dtype}{quantized}, "
               f"{sampling_words(do_sample, temperature)}, batch {batch_size}; machine: {describe_machine(device)}\n\n"
               f"{table}\n\nweights: base {base_mib:.0f} MiB, heads {heads_mib:.1f} MiB "
               f"({100 * heads_mib / base_mib:.1f}%); {bench.peak_memory(device)}\n\n"
               f"clover's draft settings, unless a variant overrides them: {tree_summary(model.clover_config)}\n\n"
               f"{bench.speculation_shares(results)}\n\n{bench.static_shares(results)}\n\n"
               f"{bench.slowest_prompts(results)}\n\n{breakdown}").replace("\n\n\n\n", "\n\n")
    (out / "results.md").write_text(summary + "\n")
    (out / "results.json").write_text(json.dumps({n: vars(r) for n, r in results.items()}, indent=1))
    png = bench.plot(results, out / "plot.png")
    print(summary)
    print(f"written: {out / 'results.md'}" + (f", {png}" if png else " (pip install matplotlib for the plot)"))


def _medusa_baseline(model, medusa_heads: str | None):
    """The Medusa heads to compare with, on the benchmarked model's base: `medusa_heads`, else the shipped
    ones (None, with a note, if this install has none)."""
    from clover_hf import embedded
    from clover_hf.hub.repo import load_heads, resolve_heads
    from clover_hf.modeling import CloverForCausalLM

    path = resolve_heads(medusa_heads) if medusa_heads else embedded.shipped_heads_path("medusa")
    if medusa_heads is None and not (path / "config.json").is_file():
        print(f"no Medusa baseline heads at {path}: benchmarking without them")
        return None
    medusa = load_heads(path, device=model.device, dtype=model.dtype)
    if medusa.config.head_type != "medusa":
        raise ValueError(f"--medusa-heads {medusa_heads} holds {medusa.config.head_type} heads, not Medusa's")
    return CloverForCausalLM(model.base_model, medusa)


def sampling_words(do_sample: bool, temperature: float | None) -> str:
    if not do_sample:
        return "greedy"
    return "sampling" + (f" (temperature {temperature})" if temperature is not None else "")


if __name__ == "__main__":
    sys.exit(main())
