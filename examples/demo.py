"""`make demo`: Clover on the embedded SmolLM2-135M-Instruct, next to plain `generate`, in one run.

Prints each answer, Clover's tokens per step, and three speeds measured on the same prompts in this
process: the base model's own `generate`, Clover's kernels with one-token steps (no speculation), and
Clover. The second tells the kernels' gain apart from what speculation adds. Untimed Clover calls come
first, until one has no step that learns how this machine multiplies (a first run on a machine learns
that, a new process makes its weight copies): `examples/first_call.py` times that part.
"""

from __future__ import annotations

import argparse
import time

import torch

from clover_hf.core.hardware import cpu_capability, describe_machine, timed
from clover_hf.cpu.dtype import default_dtype
from clover_hf.embedded import load_default
from clover_hf.tools.cli import quiet_imports

PROMPTS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
    "and must-see attractions.",
    "Explain the difference between a list and a tuple in Python, with a short example of each.",
    "Give me three tips for staying focused while working from home.",
]
WARM_UP = "Write a short poem about the sea."
WARM_UP_CALLS = 6  # untimed calls at most before the timed ones


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto: bf16 where this CPU decodes it faster than fp32 (hardware.default_dtype), else fp32")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    quiet_imports()
    dtype = default_dtype("cpu") if args.dtype == "auto" else getattr(torch, args.dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    print(f"machine: {describe_machine()}")
    print(f"loading SmolLM2-135M-Instruct ({dtype_name}, CPU capability {cpu_capability()}) with Clover heads ...")
    model, tokenizer = load_default(dtype)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    warm = tokenizer.apply_chat_template([{"role": "user", "content": WARM_UP}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=False)
    model.base_model.generate(warm, max_new_tokens=8, do_sample=False)
    start = time.perf_counter()
    for calls in range(1, WARM_UP_CALLS + 1):  # until no step of a call learns how this machine multiplies
        model.generate(warm, **kwargs)
        if not model.generation_stats.learning_steps:
            break
    print(f"warm-up, untimed: {calls} clover call(s), {time.perf_counter() - start:.1f} s (learning how this CPU "
          "multiplies, kept in the user cache, and making the weight copies)")

    plain_time = clover_time = one_time = 0.0
    plain_tokens = clover_tokens = one_tokens = steps = identical = verified = verify_steps = learning = 0
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=False)
        plain, t_plain = timed(lambda: model.base_model.generate(ids, **kwargs), model.device)
        one, t_one = timed(lambda: model.generate(ids, budget="one-token", **kwargs), model.device)
        fast, t_fast = timed(lambda: model.generate(ids, **kwargs), model.device)
        stats = model.generation_stats
        plain_time, clover_time, one_time = plain_time + t_plain, clover_time + t_fast, one_time + t_one
        plain_tokens += plain.shape[1] - ids.shape[1]
        one_tokens += one.shape[1] - ids.shape[1]
        clover_tokens, steps = clover_tokens + stats.new_tokens, steps + stats.steps
        verified, verify_steps = verified + stats.verified_tokens, verify_steps + len(stats.accepted_lengths)
        learning += stats.learning_steps
        same = plain.shape == fast.shape and bool((plain == fast).all())
        identical += same
        print(f"\n### {prompt}\n{tokenizer.decode(fast[0, ids.shape[1]:], skip_special_tokens=True)}")
        print(f"[{stats.new_tokens} tokens in {stats.steps} steps = {stats.tokens_per_step:.2f} tokens/step; "
              f"{t_plain / t_fast:.2f}x plain generate; identical to plain: {same}]")

    plain_rate, one_rate, clover_rate = plain_tokens / plain_time, one_tokens / one_time, clover_tokens / clover_time
    print(f"\n=== summary: {dtype_name}, greedy, {args.max_new_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"CPU capability {cpu_capability()} ===")
    print(f"plain generate:           {plain_rate:.1f} tokens/s")
    print(f"clover, one-token steps:  {one_rate:.1f} tokens/s ({one_rate / plain_rate:.2f}x plain: Clover's kernels "
          "alone)")
    print(f"clover:                   {clover_rate:.1f} tokens/s ({clover_tokens / steps:.2f} tokens/step, "
          f"{verified / verify_steps:.2f} verified/step)")
    print(f"speedup:                  {clover_rate / plain_rate:.2f}x plain generate, measured in this run; "
          f"speculation adds {clover_rate / one_rate:.2f}x over Clover's one-token steps")
    if learning:
        print(f"still learning:           {learning} of {verify_steps} steps ran while Clover learnt how this CPU "
              "multiplies; run `make demo` again for the steady state")
    print(f"identical to plain:       {identical}/{len(PROMPTS)}; " + (
        "exact in float32 (guaranteed and tested)." if dtype == torch.float32 else
        f"in {dtype_name} Clover's kernels sum in another order than plain generate's, so where two tokens are "
        "nearly tied the texts may part ways, neither more correct (docs/bf16.md)."))


if __name__ == "__main__":
    main()
