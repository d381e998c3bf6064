#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA device and PyTorch (no install needed: the
# package runs from src/): the tests that need CUDA, `statesnap bench --suite gpu` and the training
# suite on the GPU. Logs and JSON go to $OUT (default /tmp/statesnap-gpu). Each part has its own
# time limit, so one that hangs or fails still leaves the others' figures. On an H200 machine
# (2026-11-26) the parts took about 15, 35, 100 and 90 s: the whole fits a 7-minute call.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/statesnap-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

nvidia-smi -L 2>&1 | tee "$out/device.txt"
$py -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())' \
    2>&1 | tee -a "$out/device.txt"
echo "== tests"  # the CUDA tests all run (no -x); then the CPU suites that share their code paths
timeout "${TEST_S:-90}" $py -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/tests-gpu.log" | tail -30
timeout "${CPU_TEST_S:-90}" $py -m pytest -q -p no:cacheprovider -n "${WORKERS:-8}" tests/test_checkpointer.py \
    tests/test_checkpointer_staging.py tests/test_restore.py tests/test_save_load.py 2>&1 | tee "$out/tests-cpu.log" | tail -15
echo "== gpu suite"
timeout "${GPU_S:-150}" $py -m statesnap.bench.gpu --out "$scratch" --json "$out/gpu.json" 2>&1 | tee "$out/gpu.log"
echo "== training suite on cuda"
timeout "${TRAIN_S:-150}" $py -m statesnap.bench.training --device cuda --size-gb "${SIZE_GB:-1}" --batch 16 \
    --steps "${STEPS:-20}" --every "${EVERY:-5}" --warmup 3 --runs "${RUNS:-2}" --modes none,dcp_async,statesnap_p10,statesnap_p1 \
    --sweep-gb '' --out "$scratch" --json "$out/training.json" 2>&1 | tee "$out/training.log"
df -h "$scratch" | tail -1
