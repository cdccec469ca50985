"""What the draft budget's run-time mechanisms gain, each against its simplest fixed rule, interleaved per prompt.

One `run_benchmark` call on the embedded SmolLM2 with the shipped heads, every variant on each prompt in turn (a
machine whose speed drifts moves them all alike), each variant with a budget and a cost cache of its own:

- `clover`: the default budget (and its one-token steps, for what speculation adds);
- `clover, no weight copies`: `DraftBudget(weight_copies=False)`, the linear forms limited to those computing from
  the weights as they are;
- `clover, gate never pauses`: the heads gate that never pauses the heads (they draft every step the budget lets
  them), against the default gate that pauses them while drafting does not pay.

    python examples/mechanisms_ab.py --dtype bfloat16 --limit 20
    python examples/mechanisms_ab.py --dtype bfloat16 --limit 16 --batch-size 4 --no-no-copies-run
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from clover_hf.core.hardware import describe_machine
from clover_hf.decode.budget import DraftBudget, HeadsGate
from clover_hf.embedded import load_default
from clover_hf.tools.bench import ONE_TOKEN, markdown_table, read_prompts, run_benchmark, speculation_shares


class NeverPause(HeadsGate):
    """The heads gate without its pauses: the heads draft whenever the budget's choice lets them."""

    def record(self, *args, **kwargs) -> None:
        super().record(*args, **kwargs)
        self.pause, self.hopeless = 0, False


class UngatedBudget(DraftBudget):
    def gate_for(self, rows, setting=None) -> HeadsGate:
        return self._gates.setdefault((rows, setting), NeverPause())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--no-copies-run", action=argparse.BooleanOptionalAction, default=True,
                        help="also run without weight copies (slow where the kernel computes from them)")
    args = parser.parse_args()
    model, tokenizer = load_default(getattr(torch, args.dtype))
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b, tempfile.TemporaryDirectory() as c:
        default = DraftBudget(cache_dir=a)
        runs = {ONE_TOKEN: {"budget": default.one_token()}, "clover": {"budget": default},
                "clover, gate never pauses": {"budget": UngatedBudget(cache_dir=c)}}
        if args.no_copies_run:
            runs["clover, no weight copies"] = {"budget": DraftBudget(cache_dir=b, weight_copies=False)}
        results = run_benchmark(model, tokenizer, read_prompts("mtbench", args.limit), args.max_new_tokens,
                                prompt_lookup=False, clover_runs=runs, batch_size=args.batch_size)
    print(f"{args.limit} prompts, {args.max_new_tokens} new tokens, {args.dtype}, batch {args.batch_size}; "
          f"machine: {describe_machine()}")
    print(markdown_table(results, model.clover_config.num_heads))
    print(speculation_shares(results))


if __name__ == "__main__":
    main()
