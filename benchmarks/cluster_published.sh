#!/usr/bin/env bash
# Cluster plans on paper against published throughput (docs/auto-planning.md, "A cluster on paper").
# Each run plans the published layout (--mesh) and then searches every layout of the same cluster.
# A100 80GB nodes of 8: NVLink 300 GB/s a direction inside a node, 25 GB/s (200 Gb/s) a GPU between
# nodes; bf16 peak 312 TFLOP/s at an assumed matmul efficiency of 0.6 (an input, not a measurement; set
# here explicitly, above --cluster's default of 0.5). Each plan prints the values it assumed.
set -euo pipefail
data="$(dirname "$0")/data"
a100() { echo "nodes=$1,gpus=8,intra=300GB/s,inter=25GB/s,flops=312e12,memory=80GiB,efficiency=0.6"; }
run() { echo; echo "\$ zerobubble plan $*"; zerobubble plan "$@" || true; }

# torchtitan docs/performance.md: Llama 3 8B, 64 A100, FSDP2, local batch 1 × 8192 tokens,
# selective op recomputation: 2973 tokens/s per GPU, MFU 58.2 %
run --cluster "$(a100 8)" --model "$data/llama3_8b_config.json" --tokens-per-step 524288 --seq-len 8192 \
    --mesh pp=1,dp=64 --data-parallel fsdp
run --cluster "$(a100 8)" --model "$data/llama3_8b_config.json" --tokens-per-step 524288 --seq-len 8192 --top 3
# the same table: Llama 3 70B, 64 A100, FSDP2, full recomputation: 331 tokens/s per GPU, MFU 51.7 %
run --cluster "$(a100 8)" --model "$data/llama3_70b_config.json" --tokens-per-step 524288 --seq-len 8192 \
    --mesh pp=1,dp=64 --data-parallel fsdp --recompute
run --cluster "$(a100 8)" --model "$data/llama3_70b_config.json" --tokens-per-step 524288 --seq-len 8192 \
    --recompute --top 3
# Narayanan et al. 2021 (Megatron-LM, arXiv 2104.04473): 1T parameters (128 layers, h 25600, 160 heads)
# on 3072 A100, tp 8 × pp 64, batch 3072 × 2048 tokens, full recomputation: 163 TFLOP/s per GPU,
# 52 % of peak (hardware FLOPs, the recomputation counted): our HFU column
run --cluster "$(a100 384)" --model "$data/megatron_1t_config.json" --tokens-per-step 6291456 --seq-len 2048 \
    --mesh pp=64,dp=6,tp=8 --data-parallel replicate --recompute --schedules 1f1b
run --cluster "$(a100 384)" --model "$data/megatron_1t_config.json" --tokens-per-step 6291456 --seq-len 2048 \
    --mesh pp=64,dp=6,tp=8 --data-parallel replicate --recompute --schedules 1f1b,zb-h1
