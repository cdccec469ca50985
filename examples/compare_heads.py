"""Compare trained heads side by side: per-head accuracy on held-out sequences and tokens per forward.

For each heads directory (from `clover-hf train`): the final evaluation its training recorded
(per-head top-1 / top-5 agreement with the base's top-1 on the run's held-out sequences; runs on the
same data and seed hold out the same sequences), then greedy decoding of MT-Bench first turns in
float32 with one fixed draft tree for all (default: the shipped 10-node tree), the whole tree every
step (`budget="full"`, so tokens per forward do not depend on the machine), heads alone and with the
prompt-lookup chain. Every output is checked against plain `generate`.

    python examples/compare_heads.py runs/ablation/*/heads --limit 20
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clover_hf import CloverForCausalLM
from clover_hf.data import mtbench_questions
from clover_hf.embedded import base_model_path, shipped_heads_path

SETTINGS = {"heads alone": {"lookup": 0}, "with chain": {"lookup": 5, "lookup_max": 20}}


def final_eval(heads_dir: Path) -> list[dict] | None:
    path = heads_dir / "training_metrics.json"
    return json.loads(path.read_text()).get("eval") if path.is_file() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("heads", nargs="+", type=Path, help="heads directories")
    parser.add_argument("--limit", type=int, default=20, help="first N MT-Bench prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", type=json.loads, default=None,
                        help="draft tree as JSON paths (default: the shipped heads' tree)")
    args = parser.parse_args()
    tree = args.tree or json.loads((shipped_heads_path() / "config.json").read_text())["tree"]

    base_dir = base_model_path(torch.float32)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=False)
               for q in mtbench_questions(1)[: args.limit]]
    plain = [base.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False) for ids in prompts]

    rows = []
    for heads_dir in args.heads:
        model = CloverForCausalLM.from_pretrained(base, clover_heads=heads_dir).eval()
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


if __name__ == "__main__":
    main()
