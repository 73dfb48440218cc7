#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one prepared run on a lent machine (README, "Development"):
# the device tests (tests/runtime/test_devices.py: the B/W split of every split model, two chunks on one
# rank with CUDA-event tracing; tests/bench/test_bench_wgrad.py: bench wgrad), `zerobubble bench wgrad` on the GPU, a traced
# training run on one GPU, and a run on a one-rank CUDA DeviceMesh with NCCL (the mesh's groups, the
# Pipeline's locally synchronised groups and their count padding on NCCL; one GPU cannot hold the
# 2-rank FSDP2 or tensor-parallel runs, which are tested on gloo).  Run from the repository root with the machine's own python3 and torch;
# the logs and the trace go to $OUT (default: device-results/).
#
#   bash benchmarks/device_check.sh                             # on the GPU machine
#   DEVICE=cpu REPEATS=1 ROWS=8 STEPS=2 bash benchmarks/device_check.sh   # a dry run of the script
set -uo pipefail
out=${OUT:-device-results}
device=${DEVICE:-cuda}
mkdir -p "$out"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
python3 - <<'PY' 2>&1 | tee "$out/environment.txt" || status=1
import torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()} ({gpu})")
PY
# pytest-timeout may be missing on that machine: its required-plugins line is lifted for this run
python3 -m pytest -q -p no:cacheprovider -o required_plugins= tests/runtime/test_devices.py \
    tests/bench/test_bench_wgrad.py 2>&1 | tee "$out/tests.log" || status=1
# shellcheck disable=SC2086  # ROWS is a list of numbers
python3 -m zerobubble bench wgrad --device "$device" --repeats "${REPEATS:-21}" --rows ${ROWS:-32 128 512} \
    2>&1 | tee "$out/bench_wgrad.md" || status=1
python3 -m zerobubble train --ranks 1 --steps "${STEPS:-6}" --no-progress --trace "$out/trace" \
    2>&1 | tee "$out/train.log" || status=1
if [ "$device" = cuda ]; then
    python3 -m zerobubble train --mesh pp=1 --backend nccl --steps "${STEPS:-6}" --no-progress \
        2>&1 | tee "$out/train_mesh.log" || status=1
fi
exit "$status"
