"""What a first `generate` call costs on a machine with no stored costs, against plain `generate`.

Each timed batch gets a new `DraftBudget` with an empty cost cache, so its first Clover call times how
the machine multiplies, makes the weight copies and learns the verify costs from its own steps, as a
user's first call does; the second call then runs with all of that known. Plain `generate` is timed
before and after, and the ratios are of tokens per second against theirs (in bf16 Clover's text may end
elsewhere than plain's):

    python examples/first_call.py --batch-size 4 --batches 2

`--stored`: the first call of a new process on a machine whose costs an earlier process learnt and stored
(the forms are known, their weight copies are still to be made), as every process after a user's first runs.

`--base DIR`: a base of another family instead of the embedded model, with heads made fresh by
`CloverForCausalLM.from_base`, as a user who has trained none yet tries it (prompts as plain text when the
tokenizer has no chat template):

    python examples/first_call.py --base /tmp/gemma3-270m --dtype float32 --batches 3 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from transformers import AutoModelForCausalLM, AutoTokenizer

from clover_hf import CloverForCausalLM
from clover_hf.core.hardware import describe_machine
from clover_hf.cpu.dtype import default_dtype
from clover_hf.decode.budget import DraftBudget
from clover_hf.embedded import load_default
from clover_hf.tools.bench import encode_batches, read_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--first-prompt", type=int, default=10, help="MT-Bench first turns from this index")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--stored", action="store_true",
                        help="costs stored by an earlier process (learnt here first, on other prompts)")
    parser.add_argument("--base", default=None, help="a base model (directory or Hub id) with fresh heads")
    args = parser.parse_args()
    dtype = default_dtype("cpu") if args.dtype == "auto" else getattr(torch, args.dtype)
    model, tokenizer = load_default(dtype) if args.base is None else fresh_heads(args.base, dtype)
    count = args.batch_size * args.batches
    prompts = read_prompts("mtbench", args.first_prompt + count)[args.first_prompt:]
    batches = encode_batches(tokenizer, prompts, args.batch_size, model.device)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    model.base_model.generate(**batches[0], max_new_tokens=4, do_sample=False)  # plain's own warm-up
    print(f"machine: {describe_machine()}; {dtype}; batch {args.batch_size}")
    learn_on = encode_batches(tokenizer, read_prompts("mtbench", 3), args.batch_size, model.device)
    for k, inputs in enumerate(batches):
        with tempfile.TemporaryDirectory() as empty:
            if args.stored:  # an earlier process learns and stores the costs
                model.budget = DraftBudget(cache_dir=empty)
                for earlier in learn_on:
                    model.generate(**earlier, **kwargs)
            model.budget = DraftBudget(cache_dir=empty)  # a machine with no stored costs, or a new process
            times, tokens = [], []
            for run in (model.base_model.generate, model.generate, model.generate, model.base_model.generate):
                start = time.perf_counter()
                out = run(**inputs, **kwargs)
                times.append(time.perf_counter() - start)
                tokens.append(out.shape[1] - inputs["input_ids"].shape[1])
        # by tokens per second: in bf16 Clover's text may end elsewhere than plain's
        plain = (tokens[0] + tokens[3]) / (times[0] + times[3])
        print(f"batch {k + 1}: plain {times[0]:.2f} / {times[3]:.2f} s ({tokens[0]} tokens); Clover's first call "
              f"{times[1]:.2f} s, {tokens[1]} tokens ({tokens[1] / times[1] / plain:.2f}x plain's tokens/s), second "
              f"{times[2]:.2f} s, {tokens[2]} tokens ({tokens[2] / times[2] / plain:.2f}x)")


def fresh_heads(base: str, dtype: torch.dtype):
    """A base of the user's, wrapped with untrained heads."""
    torch.manual_seed(0)
    model = CloverForCausalLM.from_base(AutoModelForCausalLM.from_pretrained(base, dtype=dtype).eval())
    return model, AutoTokenizer.from_pretrained(base)


if __name__ == "__main__":
    main()
