"""Compare trained heads side by side: per-head accuracy on held-out sequences and tokens per forward.

For each heads directory (from `clover-hf train`): the final evaluation its training recorded
(per-head top-1 / top-5 agreement with the base's top-1 on the run's held-out sequences; runs on the
same data and seed hold out the same sequences), then greedy decoding of MT-Bench first turns in
float32 with one fixed draft tree for all (default: the shipped 10-node tree), the whole tree every
step (`budget="full"`, so tokens per forward do not depend on the machine), heads alone and with the
prompt-lookup chain. Every output is checked against plain `generate`.

    python examples/compare_heads.py runs/ablation/*/heads --limit 20
    python examples/compare_heads.py runs/gpu/*/heads --device cuda --limit 80 --json runs/gpu/accuracy.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clover_hf import CloverForCausalLM
from clover_hf.embedded import base_model_path, shipped_heads_path
from clover_hf.tools.bench import read_prompts

SETTINGS = {"heads alone": {"lookup": 0}, "with chain": {"lookup": 5, "lookup_max": 20}}


def final_eval(heads_dir: Path) -> list[dict] | None:
    path = heads_dir / "training_metrics.json"
    return json.loads(path.read_text()).get("eval") if path.is_file() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("heads", nargs="+", type=Path, help="heads directories")
    parser.add_argument("--limit", type=int, default=20, help="first N prompts")
    parser.add_argument("--prompts", default="mtbench", help="'mtbench' (first turns) or a .jsonl of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", type=json.loads, default=None,
                        help="draft tree as JSON paths (default: the shipped heads' tree)")
    parser.add_argument("--base-model", default=None, help="base model directory (default: the embedded SmolLM2)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ...; TF32 stays off, so float32 stays exact")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    tree = args.tree or json.loads((shipped_heads_path() / "config.json").read_text())["tree"]
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    base_dir = args.base_model or base_model_path(torch.float32)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=False).to(args.device)
               for q in read_prompts(args.prompts, args.limit)]
    plain = [base.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False) for ids in prompts]

    rows = []
    for heads_dir in args.heads:
        model = CloverForCausalLM.from_pretrained(base, clover_heads=heads_dir).to(args.device).eval()
        row = {"heads": str(heads_dir), "eval": final_eval(heads_dir)}
        for name, options in SETTINGS.items():
            tokens = steps = same = 0
            for ids, expected in zip(prompts, plain):
                out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, budget="full",
                                     tree=tree, **options)
                stats = model.generation_stats
                tokens, steps = tokens + stats.new_tokens, steps + stats.steps
                same += torch.equal(out, expected)
            row[name] = {"tokens_per_forward": tokens / steps, "identical": same}
        rows.append(row)
        print(heads_dir, {name: row[name] for name in SETTINGS}, flush=True)

    depth = max(len(r["eval"] or []) for r in rows)
    heads_cols = " | ".join(f"head {i} top-1 / top-5" for i in range(depth))
    print(f"\n| heads | {heads_cols} | tokens/forward, heads alone | with chain | identical to plain |")
    print("|---|" + "---|" * (depth + 3))
    for r in rows:
        accuracy = [f"{e['top1']:.3f} / {e['top5']:.3f}" for e in (r["eval"] or [])]
        accuracy += ["-"] * (depth - len(accuracy))
        same = f"{r['heads alone']['identical']}/{len(prompts)}, {r['with chain']['identical']}/{len(prompts)}"
        print(f"| {r['heads']} | " + " | ".join(accuracy) + f" | {r['heads alone']['tokens_per_forward']:.3f} | "
              f"{r['with chain']['tokens_per_forward']:.3f} | {same} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
