"""A/B of `decoding.tree_attention_backends` on a CUDA GPU: Clover with cuDNN attention turned off
during its forwards (the library's default) against Clover with cuDNN left on, next to plain
`generate`, prompt by prompt on MT-Bench first turns with the shipped heads. Then one profiled
prompt under each setting. Prints as it goes, so a cut run still reports. The timed prompts follow
one untimed warm-up per method, and the two settings take turns at running first. Clover drafts the
heads' static tree throughout (not their larger `accelerator_dynamic_tree`), as in the recorded runs.

    python examples/cuda_attention_ab.py --dtype bfloat16 --limit 8
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from transformers import AutoTokenizer

import clover_hf.decode.call as decoding  # where `decode_context` reads `tree_attention_backends`
from clover_hf import CloverForCausalLM
from clover_hf.core.hardware import timed
from clover_hf.embedded import base_model_path, shipped_heads_path
from clover_hf.training.data import mtbench_questions

SETTINGS = {"cudnn off (default)": decoding.tree_attention_backends, "cudnn on": lambda device: contextlib.nullcontext()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--device", default="cuda", help="cuda (the point of the A/B); cpu runs the same code, where both settings are one")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    path = base_model_path(dtype)
    model = CloverForCausalLM.from_pretrained(shipped_heads_path(), base_model=str(path), dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    print(f"cuDNN {torch.backends.cudnn.version()}, cudnn_sdp_enabled={torch.backends.cuda.cudnn_sdp_enabled()}")

    def encode(question: str) -> torch.Tensor:
        messages = [{"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=False).to(device)

    tree = model.clover_config.tree  # the static tree of the recorded runs, not the GPU's larger default

    def clover(ids: torch.Tensor, backends, **kwargs) -> float:
        decoding.tree_attention_backends = backends
        try:
            return timed(lambda: model.generate(ids, max_new_tokens=128, do_sample=False, tree=tree, **kwargs), device)[1]
        finally:
            decoding.tree_attention_backends = SETTINGS["cudnn off (default)"]

    questions = mtbench_questions()
    warm_up = encode(questions[-1])  # CUDA context, kernels and allocator, outside the timed prompts
    model.base_model.generate(warm_up, max_new_tokens=16, do_sample=False)
    for backends in SETTINGS.values():
        clover(warm_up, backends)
        clover(warm_up, backends, lookup=0)
    totals: dict[str, float] = {}
    limit = min(args.limit, len(questions) - 2)  # one question left for the profile, the last for the warm-up
    for i, question in enumerate(questions[:limit]):
        ids = encode(question)
        row = {"plain": timed(lambda: model.base_model.generate(ids, max_new_tokens=128, do_sample=False), device)[1]}
        settings = list(SETTINGS.items())
        for name, backends in settings if i % 2 == 0 else settings[::-1]:  # neither setting always runs first
            row[name] = clover(ids, backends)
            row[name + " heads only"] = clover(ids, backends, lookup=0)
        for key, seconds in row.items():
            totals[key] = totals.get(key, 0.0) + seconds
        print(f"[{i + 1}] " + "  ".join(f"{k}: {1000 * row[k]:.0f} ms" for k in totals), flush=True)
    print("x plain over all prompts: " + "  ".join(f"{k}: {totals['plain'] / v:.2f}" for k, v in totals.items()))

    ids = encode(questions[limit])
    for name, backends in SETTINGS.items():
        clover(ids, backends, clover_profile=True)
        stats = model.generation_stats
        # the stages are timed in verify steps only: every forward but the prefill
        print(f"profile, {name}: ms per step " + ", ".join(f"{k} {1000 * v / (stats.steps - 1):.1f}" for k, v in stats.stage_seconds.items()))


if __name__ == "__main__":
    main()
