#!/usr/bin/env bash
# One call on the lent GPU machine: install the carried tvm-ffi wheel, run the tests, run the GPU
# benchmark; logs and the JSON land in $OUT. Usage (device tool, carry [".whl"]):
#   bash tools/device_run.sh [pytest args...]
set -uo pipefail
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
export JITKV_CACHE_DIR=/tmp/jitkv-cache OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/device.txt"
t0=$(date +%s)
python3 -m jitkv prebuild --arch "$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')" --no-cpu 2>&1 | tail -8 | tee "$OUT/prebuild.log"
echo "prebuild took $(( $(date +%s) - t0 )) s" | tee -a "$OUT/prebuild.log"
python3 -m pytest -q -x -p no:cacheprovider "${@:-jitkv/tests/ops}" 2>&1 | tee "$OUT/pytest.log" | tail -25
python3 -m jitkv.benchmark --device cuda --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.md"
