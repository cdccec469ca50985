"""What the draft budget's choices are worth under a fixed cost model: a noise-free way to compare budget settings.

Decodes MT-Bench first turns with the shipped heads on the embedded SmolLM2, the verify costs fixed
(nothing is timed, so the same settings make the same choices on every run), and prices each step
off the cost model: speedup = plain decoding's cost (one 1-token forward per token) / Clover's
(each step's forward at its width, plus drafting where the heads drafted).

    python examples/budget_what_if.py --dtype float32 --limit 20
    python examples/budget_what_if.py --dtype float32 --limit 20 --set PRIOR_WEIGHT=8   # slower-learning buckets

`--set NAME=VALUE` overrides a constant of the draft budget's modules (`clover_hf.decode.budget`, `.costs`,
`.acceptance`, `.widths`; comma-separated values make a tuple).
The default costs are medians of 7 timings on an AVX2-only AMD EPYC, 2 threads, 200-token cache, with
`F.linear` at every width (before the budget chose linear forms: in float32 there, 2-16-token forwards
now cost 1.3-1.7x a one-token one instead of 1.7-2x); `--costs '{"1": 40, "2": 60, ...}'` gives
others (ms by tokens per forward).
"""

from __future__ import annotations

import argparse
import json

import torch

import clover_hf.decode.acceptance as acceptance_module
import clover_hf.decode.budget as budget_module
import clover_hf.decode.costs as costs_module
import clover_hf.decode.widths as widths_module
from clover_hf.backends.torch_backend import TorchBackend
from clover_hf.decode.budget import DraftBudget
from clover_hf.decode.costs import CostModel
from clover_hf.embedded import load_default
from clover_hf.training.data import mtbench_questions

AVX2_COSTS = {
    "float32": ({1: 69.5, 2: 117, 3: 145, 4: 126, 5: 122, 6: 123, 8: 131, 12: 134, 16: 142, 32: 165}, 3.0),
    "bfloat16": ({1: 46.5, 2: 62, 3: 81, 4: 98, 5: 105, 6: 132, 8: 167, 12: 243, 16: 315, 32: 600}, 2.0),
}


def _value(text: str):
    parts = [float(p) for p in text.split(",")]
    return tuple(parts) if len(parts) > 1 else parts[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=list(AVX2_COSTS))
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--costs", type=json.loads, default=None, help="ms by width, JSON")
    parser.add_argument("--draft-ms", type=float, default=None, help="drafting cost per step that drafts")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    for item in args.set:
        name, value = item.split("=", 1)
        homes = [module for module in (budget_module, costs_module, acceptance_module, widths_module)
                 if hasattr(module, name)]
        if not homes:
            raise SystemExit(f"the draft budget's modules have no {name}")
        setattr(homes[0], name, _value(value))
    curve, draft_ms = AVX2_COSTS[args.dtype]
    curve = {int(w): float(ms) for w, ms in (args.costs or curve).items()}
    draft_ms = args.draft_ms if args.draft_ms is not None else draft_ms
    costs = CostModel({1: curve}, draft_ms=draft_ms)

    widths: list[int] = []
    verify = TorchBackend.verify  # the verify forwards, whichever backend computes them (the prefill is apart)

    def counting_verify(self, ids, *rest):
        widths.append(ids.shape[1])
        return verify(self, ids, *rest)

    TorchBackend.verify = counting_verify
    model, tokenizer = load_default(getattr(torch, args.dtype))
    budget = DraftBudget(costs=costs)
    plain_ms = clover_ms = 0.0
    tokens = steps = 0
    for k, question in enumerate(mtbench_questions(1)[: args.limit]):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=False)
        widths.clear()
        model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, budget=budget)
        stats = model.generation_stats
        ms = sum(costs.predict(1, w) for w in widths) + draft_ms * stats.head_drafts
        plain = (stats.new_tokens - 1) * curve[1]
        plain_ms, clover_ms = plain_ms + plain, clover_ms + ms
        tokens, steps = tokens + stats.new_tokens, steps + stats.steps
        print(f"prompt {k + 1}: {plain / ms:.3f}x, {stats.tokens_per_step:.2f} tokens/step, "
              f"{stats.verified_per_step:.2f} verified/step, heads drafted on {stats.head_drafts} steps", flush=True)
    print(f"{args.dtype} {args.set or 'defaults'}: {plain_ms / clover_ms:.3f}x plain by the cost model, "
          f"{tokens / steps:.3f} tokens/step")


if __name__ == "__main__":
    main()
