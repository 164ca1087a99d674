#!/usr/bin/env bash
# The offline GPU check: install from the tree, the CUDA tests, the GPU benchmark, results under $OUT.
#
# Usage (on a GPU machine with torch installed and no network, from anywhere):
#     OUT=/tmp/out bash benchmarks/gpu/run.sh            # tests, then the benchmark
#     bash benchmarks/gpu/run.sh --tests-only             # what `make test-cuda` runs
# Stages and their time limits (8 minutes in all on one H200, each stage cut off at its limit):
#   install (benchmarks/gpu/install_offline.py: links the tree as the package, no build, no pip unless a
#   dependency is missing and benchmarks/gpu/wheelhouse/ has it)       ~5 s
#   no GPU visible: says so, writes $OUT/summary.json, exits 2          (what the CPU rehearsal checks)
#   pytest -m cuda (fails, not skips, without a GPU)                    MEGATRAIN_TEST_S, default 140 s
#   benchmarks/gpu_step.py, its default cases (rows kept as they come)  MEGATRAIN_BENCH_S, default 160 s
#   benchmarks/gpu/peers.py: FSDP2 (CPUOffloadPolicy) and DeepSpeed ZeRO-3 (CPU offload) on the cases
#   MEGATRAIN_PEER_CASES (default 1b@2048,llama2-7b:4), each run cut off at MEGATRAIN_PEER_S (default 40 s)
#   benchmarks/gpu/table.py: the JSON lines -> $OUT/results.md, megatrain's tokens/s over each peer's  ~1 s
# Exit status: 0 all passed, 1 tests failed, 2 no GPU, 3 install failed, 4 benchmark failed or cut off.
# PYTHON picks the interpreter (default python3); extra arguments after -- go to gpu_step.py.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/out/gpu}
TESTS_ONLY=0
BENCH_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tests-only) TESTS_ONLY=1 ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    *) echo "gpu/run.sh: unknown argument $1" >&2; exit 64 ;;
  esac
  shift
done
mkdir -p "$OUT"
SITE=$(mktemp -d "${TMPDIR:-/tmp}/megatrain-site.XXXXXX")
trap 'rm -rf "$SITE"' EXIT
summary() {  # status, note
  "$PY" -c 'import json,sys; json.dump({"status": sys.argv[1], "note": sys.argv[2]}, open(sys.argv[3], "w"))' \
    "$1" "$2" "$OUT/summary.json"
}

echo "gpu/run.sh: installing from $ROOT (offline)"
if ! "$PY" "$ROOT/benchmarks/gpu/install_offline.py" --site "$SITE" --tests --peers; then
  summary install-failed "see the messages above"; exit 3
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"

GPU=$("$PY" -P -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")')
if [ -z "$GPU" ]; then
  echo "gpu/run.sh: no GPU visible (torch.cuda.is_available() is False): nothing tested or measured"
  summary no-gpu "torch sees no GPU"; exit 2
fi
echo "gpu/run.sh: $GPU"

# the files that hold CUDA tests (tests/test_gpu_script.py checks the list): collecting all of tests/ would
# need the planner tests' hypothesis, which a GPU image may lack
CUDA_TEST_FILES=(tests/runtime/test_cuda.py tests/runtime/test_cuda_long.py tests/runtime/test_device.py
  tests/runtime/test_distributed.py)
MEGATRAIN_REQUIRE_CUDA=1 timeout "${MEGATRAIN_TEST_S:-140}" "$PY" -P -m pytest -m cuda -x -q \
  --junitxml "$OUT/cuda_tests.xml" "${CUDA_TEST_FILES[@]}"
TEST_RC=$?
[ "$TEST_RC" -eq 0 ] && echo "gpu/run.sh: CUDA tests passed" || echo "gpu/run.sh: CUDA tests failed ($TEST_RC)"
if [ "$TESTS_ONLY" -eq 1 ]; then
  summary "$([ "$TEST_RC" -eq 0 ] && echo passed || echo tests-failed)" "$GPU; tests only"
  [ "$TEST_RC" -eq 0 ]; exit $?
fi

rm -f "$OUT/gpu_step.jsonl" "$OUT/peers.jsonl"
timeout "${MEGATRAIN_BENCH_S:-160}" "$PY" -P benchmarks/gpu_step.py --out "$OUT/gpu_step.jsonl" "${BENCH_ARGS[@]}"
BENCH_RC=$?
IFS=, read -r -a PEER_CASES <<< "${MEGATRAIN_PEER_CASES:-1b@2048,llama2-7b:4}"
for system in fsdp2 deepspeed; do
  for case in "${PEER_CASES[@]}"; do
    timeout "${MEGATRAIN_PEER_S:-40}" "$PY" -P benchmarks/gpu/peers.py --system "$system" --case "$case" \
      --out "$OUT/peers.jsonl" \
      || echo "{\"system\": \"$system\", \"case\": \"$case\", \"error\": \"cut off or failed ($?)\"}" >> "$OUT/peers.jsonl"
  done
done
"$PY" -P benchmarks/gpu/table.py "$OUT/gpu_step.jsonl" --peers "$OUT/peers.jsonl" --gpu "$GPU" > "$OUT/results.md"
cat "$OUT/results.md"
if [ "$TEST_RC" -ne 0 ]; then summary tests-failed "$GPU"; exit 1; fi
if [ "$BENCH_RC" -ne 0 ]; then summary bench-failed "$GPU; gpu_step.py exit $BENCH_RC (124: cut off)"; exit 4; fi
summary passed "$GPU"
