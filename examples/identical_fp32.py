"""Greedy Clover against plain `generate` on the embedded SmolLM2 in float32, prompt by prompt: how many
outputs are identical (all of them should be), and the speed of the two, run side by side:

    python examples/identical_fp32.py --limit 80
"""

from __future__ import annotations

import argparse
import time

import torch

from clover_hf.core.hardware import describe_machine
from clover_hf.tools.bench import read_prompts
from clover_hf.tools.cli import quiet_imports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=80, help="the first N MT-Bench first turns")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    quiet_imports()
    from clover_hf.embedded import load_default

    model, tokenizer = load_default(torch.float32)
    print(f"machine: {describe_machine(torch.device('cpu'))}")

    def encode(text: str) -> dict[str, torch.Tensor]:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)

    model.generate(**encode("hi"), max_new_tokens=8, do_sample=False)  # warm-up: forms, copies, costs
    different, plain_s, clover_s, tokens, steps = [], 0.0, 0.0, 0, 0
    prompts = read_prompts("mtbench", args.limit)
    for i, text in enumerate(prompts):
        inputs = encode(text)
        start = time.perf_counter()
        reference = model.base_model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        plain_s += time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        clover_s += time.perf_counter() - start
        identical = torch.equal(out, reference)
        if not identical:
            different.append(i)
        tokens += out.shape[1] - inputs["input_ids"].shape[1]
        steps += model.generation_stats.steps
        print(f"[{i + 1}/{len(prompts)}] {'identical' if identical else 'DIFFERENT'}; "
              f"so far {i + 1 - len(different)}/{i + 1} identical, Clover {plain_s / clover_s:.2f}x plain", flush=True)
    print(f"float32: {len(prompts) - len(different)}/{len(prompts)} identical to plain generate (different: {different or 'none'}); "
          f"Clover {plain_s / clover_s:.2f}x plain generate's time, {tokens / steps:.2f} tokens per forward")


if __name__ == "__main__":
    main()
