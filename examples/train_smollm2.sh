#!/usr/bin/env bash
# How the heads shipped in clover_hf/pretrained/smollm2-135m-instruct (and the Medusa baseline at the
# end) were trained (2-core CPU, in six stages, each its own run; every stage resumes after an
# interruption when rerun).
#   1. ShareGPT first-turn prompts answered by SmolLM2 itself (greedy), shortest prompts first, for a
#      fixed time budget; fresh heads.
#   2. Warm start from 1: ShareGPT's own conversations (records 0-1199, cut to 512 tokens) with the
#      base's soft labels, plus stage 1's cached features.
#   3. Warm start from 2: ShareGPT records 1200-2399 the same way, plus the features of stages 1 and 2.
#   4. Warm start from 3: ShareGPT records 2400-3599 the same way, plus the features of stages 1-3.
#   5. Warm start from 4: ShareGPT records 3600-4799 the same way, plus the features of stages 1-4.
#   6. Warm start from 5: ShareGPT records 4800-5999 the same way, plus the features of stages 1-5.
# A seventh stage, on a GPU, was tried and not shipped (examples/train_smollm2_stage7.sh, BENCHMARKS.md).
# MT-Bench is never used for training (it is the benchmark).
set -euo pipefail
BASE=$(python -c "import torch; from clover_hf.embedded import base_model_path; print(base_model_path(torch.bfloat16))")
COMMON=(--base-model "$BASE" --num-heads 4 --draft-vocab-size 8192 --tree-size 24 --batch-size 8
        --warmup-steps 30 --mixed-precision bf16 --eval-every 200 --save-every 100)

clover-hf train "${COMMON[@]}" --self-distill --max-records 3000 \
    --distill-max-new-tokens 256 --distill-batch-size 48 --distill-max-minutes "${DISTILL_MINUTES:-35}" \
    --max-length 1024 --max-steps 700 --lr 1e-3 --output-dir runs/smol-data

clover-hf train "${COMMON[@]}" --data sharegpt --max-records 1200 --max-length 512 \
    --extra-features runs/smol-data/features-*/ --init-heads runs/smol-data/heads \
    --max-steps 600 --lr 1e-3 --output-dir runs/smol-mix

clover-hf train "${COMMON[@]}" --data sharegpt --skip-records 1200 --max-records 1200 --max-length 512 \
    --extra-features runs/smol-mix/features-*/ runs/smol-data/features-*/ --init-heads runs/smol-mix/heads \
    --max-steps 600 --lr 7e-4 --output-dir runs/smol-mix2

clover-hf train "${COMMON[@]}" --data sharegpt --skip-records 2400 --max-records 1200 --max-length 512 \
    --extra-features runs/smol-mix2/features-*/ runs/smol-mix/features-*/ runs/smol-data/features-*/ \
    --init-heads runs/smol-mix2/heads --max-steps 900 --lr 6e-4 --eval-every 300 --output-dir runs/smol-mix3

clover-hf train "${COMMON[@]}" --data sharegpt --skip-records 3600 --max-records 1200 --max-length 512 \
    --extra-features runs/smol-mix3/features-*/ runs/smol-mix2/features-*/ runs/smol-mix/features-*/ \
    runs/smol-data/features-*/ --init-heads runs/smol-mix3/heads --max-steps 900 --lr 6e-4 --eval-every 300 \
    --output-dir runs/smol-mix4

clover-hf train "${COMMON[@]}" --data sharegpt --skip-records 4800 --max-records 1200 --max-length 512 \
    --extra-features runs/smol-mix4/features-*/ runs/smol-mix3/features-*/ runs/smol-mix2/features-*/ \
    runs/smol-mix/features-*/ runs/smol-data/features-*/ --init-heads runs/smol-mix4/heads --max-steps 900 --lr 6e-4 \
    --eval-every 300 --output-dir runs/smol-mix5

# packaged with the static tree and lookup chain that were fastest in a sweep on 8 MT-Bench prompts (bf16);
# the chain doubles up to 20 tokens while the text copies earlier text; on a GPU, at batch size 1, a 128-node
# dynamic tree (fastest of 10/32/64/128 nodes on an H100, BENCHMARKS.md, "Tree size: small on the CPU, large on a GPU")
python examples/package_heads.py runs/smol-mix5/heads \
    --tree '[[0],[1],[2],[3],[4],[0,0],[0,1],[1,0],[2,0],[0,0,0]]' --lookup 5 --lookup-max 20 \
    --accelerator-tree '{"depth": 4, "width": 16, "nodes": 128}'

# The Medusa-1 baseline beside them (clover_hf/pretrained/smollm2-135m-instruct-medusa): fresh heads on
# stage 6's data, whose features the run finds cached when its feature directory is stage 6's
# (e.g. `ln -s ../smol-mix5/features-* runs/medusa/`); its own 10-node tree from its measured acceptance,
# no lookup chain (Medusa as published).
clover-hf train "${COMMON[@]}" --data sharegpt --skip-records 4800 --max-records 1200 --max-length 512 \
    --extra-features runs/smol-mix4/features-*/ runs/smol-mix3/features-*/ runs/smol-mix2/features-*/ \
    runs/smol-mix/features-*/ runs/smol-data/features-*/ --head-type medusa --tree-size 10 \
    --max-steps 1200 --warmup-steps 50 --lr 1e-3 --eval-every 400 --output-dir runs/medusa
python examples/package_heads.py runs/medusa/heads
