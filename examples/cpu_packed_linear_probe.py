"""Probe: how much of a bf16 forward on the CPU goes to laying out linear weights, and what prepacked
oneDNN weights would do for plain decoding and for Clover alike (measured for BENCHMARKS.md; not a
library feature: packed copies of every linear weight, the tied lm_head's included, about double the
weights' memory, and the gain is not Clover's to claim).

Stock `F.linear` in bf16 hands oneDNN a plain weight, which (judging by the gain; not traced) it lays
out anew on every call; `torch.ops.mkldnn._reorder_linear_weight` does that once (the kernel inductor
uses with freezing).
Runs on MT-Bench first turns with the shipped heads, each method prompt by prompt, after a warm-up:

    python examples/cpu_packed_linear_probe.py --limit 8
"""

from __future__ import annotations

import argparse
import contextlib
import time
import types

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from clover_hf import CloverForCausalLM
from clover_hf.core.hardware import timed
from clover_hf.embedded import base_model_path, shipped_heads_path
from clover_hf.training.data import mtbench_questions


def add_packed_weights(model: torch.nn.Module) -> dict[str, bool]:
    """Give every nn.Linear a packed copy of its weight, used while the returned switch is on."""
    switch = {"on": False}

    def forward(self, x):
        if switch["on"]:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
            module.forward = types.MethodType(forward, module)
    return switch


@contextlib.contextmanager
def packed(switch: dict[str, bool], on: bool):
    switch["on"] = on
    try:
        yield
    finally:
        switch["on"] = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=8, help="timed prompts (one more runs first as a warm-up)")
    args = parser.parse_args()
    dtype = torch.bfloat16
    path = base_model_path(dtype)
    model = CloverForCausalLM.from_pretrained(shipped_heads_path(), base_model=str(path), dtype=dtype).eval()
    base, tokenizer = model.base_model, AutoTokenizer.from_pretrained(path)
    switch = add_packed_weights(base)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    # One forward of k new tokens over a 300-token cache, stock against packed, same inputs.
    ids = torch.randint(0, base.config.vocab_size, (1, 300))
    for k in (1, 16):
        new = torch.randint(0, base.config.vocab_size, (1, k))
        times, logits = {}, {}
        for on in (False, True, False, True):
            with torch.no_grad(), packed(switch, on):
                best = float("inf")
                for _ in range(10):
                    out = base(input_ids=ids, use_cache=True)
                    start = time.perf_counter()
                    logits[on] = base(input_ids=new, past_key_values=out.past_key_values).logits
                    best = min(best, time.perf_counter() - start)
            times[on] = min(times.get(on, best), best)
        print(f"forward of {k} token(s): stock {1000 * times[False]:.1f} ms, packed {1000 * times[True]:.1f} ms, "
              f"logits bitwise equal: {torch.equal(logits[False], logits[True])}")

    decoders = {"plain generate": base, "clover": model}
    methods = {name + (", packed" if on else ""): (decoder, on) for name, decoder in decoders.items() for on in (False, True)}
    totals = {name: [0, 0.0] for name in methods}
    same = {"plain": 0, "clover": 0}  # packed output == stock output, per decoder
    order = list(methods)
    for i, question in enumerate(mtbench_questions()[: args.limit + 1]):
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        outputs = {}
        for name in order if i % 2 else order[::-1]:  # no method always runs first
            decoder, on = methods[name]
            with packed(switch, on):
                outputs[name], seconds = timed(
                    lambda: decoder.generate(**inputs, max_new_tokens=128, do_sample=False), base.device)
            if i:  # the first prompt warms up
                totals[name][0] += outputs[name].shape[1] - inputs["input_ids"].shape[1]
                totals[name][1] += seconds
        if i:
            same["plain"] += torch.equal(outputs["plain generate"], outputs["plain generate, packed"])
            same["clover"] += torch.equal(outputs["clover"], outputs["clover, packed"])
            plain = totals["plain generate"][0] / totals["plain generate"][1]
            print(f"[{i}/{args.limit}] " + "  ".join(
                f"{name}: {n / s:.1f} tok/s ({n / s / plain:.2f}x)" for name, (n, s) in totals.items()), flush=True)
    print(f"packed output identical to stock: plain {same['plain']}/{args.limit}, clover {same['clover']}/{args.limit}")


if __name__ == "__main__":
    main()
