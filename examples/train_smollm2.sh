#!/usr/bin/env bash
# How the heads shipped in clover_hf/pretrained/smollm2-135m-instruct were trained (2-core CPU).
# ShareGPT first-turn prompts answered by SmolLM2 itself (greedy), shortest prompts first, for a fixed
# time budget; MT-Bench is never used for training (it is the benchmark).
set -euo pipefail
BASE=$(python -c "import torch; from clover_hf.embedded import base_model_path; print(base_model_path(torch.bfloat16))")
clover-hf train --base-model "$BASE" --self-distill --max-records 3000 \
    --distill-max-new-tokens 256 --distill-batch-size 48 --distill-max-minutes "${DISTILL_MINUTES:-35}" \
    --max-length 1024 --num-heads 4 --draft-vocab-size 8192 --tree-size 24 \
    --max-steps "${STEPS:-600}" --batch-size 8 --warmup-steps 30 --lr 1e-3 \
    --mixed-precision bf16 --eval-every 200 --save-every 100 \
    --output-dir runs/smol-data
# packaged with the 10-node tree that was fastest in a tree-size sweep on 8 MT-Bench prompts (bf16)
python examples/package_heads.py runs/smol-data/heads --tree-size 10
