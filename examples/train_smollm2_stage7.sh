#!/usr/bin/env bash
# Stage 7, tried on one H100 in about 10 minutes and not shipped (about 1% more tokens per forward on
# MT-Bench; BENCHMARKS.md, "More self-distilled training data"): warm start from the shipped stage-6 heads on prompts of
# up to 1,500 characters from ShareGPT records 6000 onwards (which no earlier stage used), answered by
# SmolLM2 itself, shortest first, for 3.5 minutes (6,144 answers there); trained on these alone.
# Rerunning resumes (answered prompts, feature shards, checkpoints); use --distill-max-minutes 0 to
# train on the answers already made.
set -euo pipefail
BASE=$(python -c "import torch; from clover_hf.embedded import base_model_path; print(base_model_path(torch.bfloat16))")
HEADS=$(python -c "from clover_hf.embedded import shipped_heads_path; print(shipped_heads_path())")
mkdir -p runs
python - <<'PY'
import json
from clover_hf.data import sharegpt_conversations
from clover_hf.features import first_prompt
with open("runs/prompts-6000.jsonl", "w") as f:
    for c in sharegpt_conversations()[6000:]:
        if len((p := first_prompt(c))[-1]["content"]) <= 1500:
            f.write(json.dumps({"messages": p}) + "\n")
PY
clover-hf train --base-model "$BASE" --data runs/prompts-6000.jsonl --self-distill --distill-batch-size 256 \
    --distill-max-minutes 3.5 --distill-max-new-tokens 256 --max-length 768 --init-heads "$HEADS" \
    --num-heads 4 --draft-vocab-size 8192 --tree-size 10 --max-steps 3000 --batch-size 16 --lr 3e-4 \
    --warmup-steps 50 --mixed-precision bf16 --eval-every 1000 --save-every 250 --output-dir runs/gpu7
