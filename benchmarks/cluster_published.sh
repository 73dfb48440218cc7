#!/usr/bin/env bash
# Cluster plans on paper against published throughput (docs/auto-planning.md, "A cluster on paper").
# `plan --published` plans every published run's own layout (src/zerobubble/data/published_runs.json:
# Narayanan et al. 2021 Table 1, torchtitan's Llama 3 on 64 A100) at one matmul efficiency calibrated
# on one row (the table's first), and prints the published figure, the prediction and their ratio; then
# the efficiency calibrated on each Table 1 row in turn (how far the ratios move with the anchor), and
# the best layouts the planner finds for
# torchtitan's two clusters. A100 80GB nodes of 8: NVLink 300 GB/s a direction, 25 GB/s a GPU
# between nodes, 312 TFLOP/s bf16 peak, 2039 GB/s of memory bandwidth.
set -euo pipefail
data="$(dirname "$0")/data"
run() { echo; echo "\$ zerobubble plan $*"; zerobubble plan "$@" || true; }

run --published
run --published --anchors
a100="nodes=8,gpus=8,intra=300GB/s,inter=25GB/s"
run --cluster "$a100" --model "$data/llama3_70b_config.json" --tokens-per-step 524288 --seq-len 8192 \
    --recompute --top 5
run --cluster "$a100" --model "$data/llama3_8b_config.json" --tokens-per-step 524288 --seq-len 8192 --top 3
