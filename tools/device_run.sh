#!/usr/bin/env bash
# One call on the lent GPU machine: install the carried tvm-ffi wheel, prebuild the CUDA kernels,
# run the GPU benchmark, then the tests; logs and the JSON land in $OUT.
# Usage (device tool, carry [".whl"]):  bash tools/device_run.sh [bench seconds] [test seconds] [pytest args...]
# (0 seconds skips that part.)
set -uo pipefail
bench_s=${1:-200}; test_s=${2:-300}; shift $(( $# < 2 ? $# : 2 ))
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
export JITKV_CACHE_DIR=/tmp/jitkv-cache OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/device.txt"
arch=$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
t0=$(date +%s)
python3 -m jitkv prebuild --arch "$arch" --no-cpu --jobs 8 > "$OUT/prebuild.log" 2>&1
echo "prebuild exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/prebuild.log"
if [ "$bench_s" -gt 0 ]; then
  timeout "$bench_s" python3 -m jitkv.benchmark --device cuda --json "$OUT/bench.json" > "$OUT/bench.md" 2>&1
  echo "benchmark exit $?" >> "$OUT/bench.md"
fi
if [ "$test_s" -gt 0 ]; then
  timeout "$test_s" python3 -m pytest -q -p no:cacheprovider --maxfail=15 --durations=10 "${@:-jitkv/tests/ops}" > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?" >> "$OUT/pytest.log"
fi
tail -5 "$OUT/prebuild.log"; [ -f "$OUT/bench.md" ] && grep -v "^$" "$OUT/bench.md" | tail -80; [ -f "$OUT/pytest.log" ] && tail -40 "$OUT/pytest.log"
