#!/usr/bin/env bash
# A small ablation of the heads' options on a 2-core CPU: every variant trains from fresh heads on the
# same cached features (ShareGPT records 0-799 cut to 256 tokens, the base in float32, its top-8 as soft
# labels) for the same steps, batch and learning rate, then examples/compare_heads.py compares them
# (per-head accuracy on the same held-out sequences; tokens per forward on MT-Bench with the shipped
# tree). A short budget ranks how fast each variant learns, not where it ends: the shipped heads had
# 4,600 steps of batch 8 over six stages.
#   OUT=runs/ablation STEPS=300 bash examples/ablate_heads.sh [variant ...]
# EXTRA adds options to every run, e.g. EXTRA="--seed 1" for a replicate (another init, data order and
# held-out split) in another OUT.
set -euo pipefail
OUT=${OUT:-runs/ablation}
STEPS=${STEPS:-300}
BASE=$(python -c "import torch; from clover_hf.embedded import base_model_path; print(base_model_path(torch.float32))")
COMMON=(--base-model "$BASE" --base-dtype float32 --data sharegpt --max-records 800 --max-length 256
        --num-heads 4 --draft-vocab-size 8192 --tree-size 10 --batch-size 8 --max-steps "$STEPS"
        --warmup-steps 30 --lr 1e-3 --eval-fraction 0.1 --eval-every 0 --save-every 50)
declare -A VARIANTS=(
  [clover]=""                                                  # the defaults: 1 Augmenting layer, residual heads
  [clover-augment2]="--num-augment-layers 2"
  [clover-linear]="--output-head linear --init-norms-from-base"  # Clover-2's public code
  [clover-feature10]="--feature-loss-weight 10"                  # Clover-2's feature-loss weight
  [clover-hard]="--label-top-k 1"                                # cross-entropy on the base's top-1
  [clover-vocab16k]="--draft-vocab-size 16384"                   # draft vocabulary: 16k most frequent tokens
  [clover-vocab32k]="--draft-vocab-size 32768"
  [clover-vocaball]="--draft-vocab-size 49152"                   # SmolLM2's whole vocabulary
  [medusa]="--head-type medusa"                                  # the shipped baseline: Clover's loss, shared rows
  [medusa1]="--head-type medusa --own-lm-heads --label-top-k 1 --feature-loss-weight 0"  # Medusa-1
)
mkdir -p "$OUT"
[ $# -gt 0 ] || set -- clover medusa1 clover-augment2 clover-linear clover-feature10 clover-hard medusa
for v in "$@"; do
  mkdir -p "$OUT/$v"
  # the first variant caches the features; the others read them through a link
  for f in "$OUT"/*/features-*; do
    [ -e "$OUT/$v/$(basename "$f")" ] || ln -s "$(realpath "$f")" "$OUT/$v/"
  done
  # shellcheck disable=SC2086
  clover-hf train "${COMMON[@]}" ${VARIANTS[$v]} ${EXTRA:-} --output-dir "$OUT/$v"
done
