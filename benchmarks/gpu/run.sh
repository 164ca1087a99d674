#!/usr/bin/env bash
# The device run as a single shot: install from the tree and the carried bundle, measure the machine, run the
# CUDA tests, then the benchmark cases, each in its own process under its own time limit; results in $OUT.
#
# The device call (the device tool's `run`, from the repository root; docs/GPU.md):
#     command:   bash benchmarks/gpu/run.sh
#     carry:     ["benchmarks/gpu/bundle"]
#     timeout_s: 540
# Before it, where a registry is reachable: `make gpu-bundle` fills benchmarks/gpu/bundle/ (git-ignored, so
# only `carry` takes it to the device) with the wheels the device image lacks.
# Rehearsal on a CPU-only machine, every stage under the fake CUDA backend at tiny sizes (what CI runs):
#     make gpu-bundle && bash benchmarks/gpu/run.sh --rehearse [--short]
#
# Stages, in order, each its own process under `timeout` (limits in seconds: 474 in all on an H100 or H200,
# with a few seconds between stages; `--list` prints them):
#   bundle       benchmarks/gpu/bundle/ was carried; else it says so and stops at once (exit 3)        1
#   install      install_offline.py: the tree linked in as the package, the bundle's wheels it lacks,
#                the GPU's name                                                                       20
#   preflight    preflight.py: bf16 matmul, pinned h2d/d2h, host first-touch and stream, cast rate per
#                thread count, host optimizer rates, the kind's host memory -> the profile every case
#                plans with ($OUT/hardware.json), megatrain's GPU budget and the peers' case          20
#   ds-cpu-adam  DeepSpeed's CPU Adam built by its JIT op builder in the background, from the start of
#                the CUDA tests to the first DeepSpeed run (off the clock: it overlaps them)         (150)
#   cuda-tests   pytest -m cuda, every test run (no -x), each cut off at 40 s; junit in $OUT          90
#   headline     llama3-8b at 8192 tokens (gpu_step.py)                                              100
#   peer-1..6    megatrain, fsdp2, deepspeed, megatrain, fsdp2, deepspeed on one case (peers.py
#                choose_case: the largest llama2-7b truncation all three hold in the host memory, cut
#                to what a run's limit allows by the preflight's rates), 28 s each                   168
#   qwen2.5-14b  qwen2.5-14b at 4096 tokens under the host policy that fits (gpu_step.py)            72
#   headline-streamed  optional: the headline again with every unit streamed (--resident none), the plan
#                the residency pass replaced, so the two are measured on one machine; runs only when the
#                run's budget has STREAMED_MIN_S (60) left, under the time left                        (100)
#   table        table.py: $OUT/results.md                                                             3
#   depth-throughput  optional: depth_throughput.py, the depth mixings' eager training throughput at the
#                125m and 1b shapes in bf16 ($OUT/depth_throughput.json); runs only when the run's budget
#                (RUN_BUDGET_S, the call's 540 s less 10) has DEPTH_MIN_S (60) left, under the time left   (240)
# `--depth-only`: bundle, install and depth-throughput alone (a call of its own: timeout_s 300).
# $OUT (at most 8 files): run.log (everything printed), summary.json (every stage: status, seconds, limit,
# note; rewritten after each stage), preflight.json, hardware.json, rows.jsonl (one line per case or peer
# run, appended as it is made), cuda_tests.xml, results.md, depth_throughput.json.
# Exit status: 0 every stage ok (summary.py: passed, measured, rehearsed or skipped), 1 a stage was not,
# 2 no GPU visible, 3 the bundle was not carried or the install failed.
# Environment: PYTHON (default python3), OUT (default out/gpu), HOST_MEM (default: the kind's 128 GiB less
# 8 GiB), GPU_MEM (megatrain's budget; default 90% of the GPU), PEER_CASE (default: the preflight's choice),
# BUNDLE (default benchmarks/gpu/bundle); the rehearsal's REHEARSE_VENV and REHEARSE_TESTS (a -k expression).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUNDLE=${BUNDLE:-$ROOT/benchmarks/gpu/bundle}
MODE=device SHORT=0 TESTS_ONLY=0 LIST=0 DEPTH_ONLY=0 RUN_T0=$(date +%s.%N)
for arg in "$@"; do
  case "$arg" in
    --rehearse) MODE=rehearse ;;
    --short) SHORT=1 ;;  # the rehearsal without DeepSpeed's CPU Adam build (minutes on 2 cores), for CI
    --tests-only) TESTS_ONLY=1 ;;
    --depth-only) DEPTH_ONLY=1 ;;
    --list) LIST=1 ;;  # print the stages and their limits, run nothing
    *) echo "gpu/run.sh: unknown argument $arg" >&2; exit 64 ;;
  esac
done

# -- what each mode runs: the device's cases, or the rehearsal's stand-ins on the fake CUDA backend -----------
if [ "$MODE" = device ]; then
  PY=${PYTHON:-python3}
  HEADLINE=llama3-8b@8192 BIG=qwen2.5-14b@4096 BIG_ARGS=(--host-policy bf16-moments) PEER_DEVICE=cuda STEPS=3 PEER_STEPS=2
  LIMITS=(bundle=1 install=20 preflight=20 ds-cpu-adam=150 cuda-tests=90 headline=100 peer=28 qwen2.5-14b=72
          table=3 headline-streamed=100 depth-throughput=240)
  RUN_BUDGET_S=${RUN_BUDGET_S:-530} DEPTH_ARGS=()
  TEST_SELECT=() TEST_TIMEOUT=40
else  # tiny models, one or two steps, limits for 2 CPU cores; the peers' wiring on the CPU (gloo)
  HEADLINE=tiny@128 BIG=small@64 BIG_ARGS=(--host-mem 200MB --host-policy bf16-moments) PEER_DEVICE=cpu STEPS=2 PEER_STEPS=1
  LIMITS=(bundle=1 venv=240 install=60 preflight=60 ds-cpu-adam=900 cuda-tests=240 headline=120 peer=120
          qwen2.5-14b=120 table=10 headline-streamed=120 depth-throughput=90)
  RUN_BUDGET_S=${RUN_BUDGET_S:-100000} DEPTH_ARGS=(--rehearse)  # the rehearsal always reaches its stage
  # the CUDA tests that take seconds on a CPU: the device's own, the policies, pinned host bytes, packed
  # attention, checkpoints; the rest differ in size (the device runs every one), and `make test` runs them all
  # on the fake backend (test-cuda-fake)
  TEST_SELECT=(-k "${REHEARSE_TESTS:-test_device or policies_stream or host_bytes_equal or page_locks or packed_attention or checkpoint_and_resume}")
  TEST_TIMEOUT=120
  export MEGATRAIN_FAKE_CUDA=1 HOST_MEM=${HOST_MEM:-8GiB} PEER_CASE=${PEER_CASE:-tiny@64}
fi
limit() {  # a stage's limit in seconds (peer-N-SYSTEM: the peers' one)
  local kv want=$1; case "$want" in peer-*) want=peer ;; esac
  for kv in "${LIMITS[@]}"; do [ "${kv%%=*}" = "$want" ] && echo "${kv#*=}"; done
}
PEERS=(megatrain fsdp2 deepspeed megatrain fsdp2 deepspeed)
STAGES=(bundle $([ "$MODE" = rehearse ] && echo venv) install preflight ds-cpu-adam cuda-tests headline)
for i in "${!PEERS[@]}"; do STAGES+=("peer-$((i + 1))-${PEERS[$i]}"); done
STAGES+=(qwen2.5-14b headline-streamed table depth-throughput)
[ "$TESTS_ONLY" -eq 1 ] && STAGES=(bundle $([ "$MODE" = rehearse ] && echo venv) install cuda-tests)
[ "$DEPTH_ONLY" -eq 1 ] && STAGES=(bundle $([ "$MODE" = rehearse ] && echo venv) install depth-throughput)
DEPTH_MIN_S=${DEPTH_MIN_S:-60} STREAMED_MIN_S=${STREAMED_MIN_S:-60}
specs=(); for s in "${STAGES[@]}"; do specs+=("$s=$(limit "$s")"); done
if [ "$LIST" -eq 1 ]; then printf '%s\n' "${specs[@]}"; exit 0; fi

OUT=${OUT:-$ROOT/out/gpu$([ "$MODE" = rehearse ] && echo -rehearse)}
mkdir -p "$OUT"
rm -f "$OUT"/{run.log,summary.json,preflight.json,hardware.json,rows.jsonl,cuda_tests.xml,results.md,depth_throughput.json}
exec > >(tee -a "$OUT/run.log") 2>&1  # everything printed from here on, also in $OUT/run.log
TEE=$!
WORK=$(mktemp -d "${TMPDIR:-/tmp}/megatrain-gpu.XXXXXX")
trap 'rm -rf "$WORK"; exec 1>&- 2>&-; wait "$TEE" 2>/dev/null' EXIT
SUM=(python3 -S "$ROOT/benchmarks/gpu/summary.py")  # the standard library alone: no site, a fast start
ROWS=$OUT/rows.jsonl

# -- bundle: checked before anything slow, so a call without `carry` ends in its first second -----------------
if ! compgen -G "$BUNDLE/*.whl" > /dev/null; then
  echo "gpu/run.sh: $BUNDLE was not carried: the device call needs carry [\"benchmarks/gpu/bundle\"] (make gpu-bundle builds it)"
  "${SUM[@]}" init "$OUT/summary.json" --mode "$MODE" "${specs[@]}" --final \
    --set "bundle=failed: $BUNDLE missing (carry [\"benchmarks/gpu/bundle\"])"
  exit 3
fi
"${SUM[@]}" init "$OUT/summary.json" --mode "$MODE" "${specs[@]}" --set "bundle=passed"

log() { echo "gpu/run.sh: $*"; }
now() { date +%s.%N; }
since() { python3 -S -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.1f}')" "$1"; }
finish() {  # exit status: the summary's verdict, or the one given
  "${SUM[@]}" final "$OUT/summary.json" --gpu "${GPU:-}"; local rc=$?
  exit "${1:-$rc}"
}
# stage NAME [--limit S] [--rows|--junit|--json F] -- CMD...: CMD under the stage's limit (or S), its status
# into the summary
stage() {
  local name=$1 lim; lim=$(limit "$1"); shift
  [ "$1" = --limit ] && { lim=$2; shift 2; }
  local extra=(); while [ "$1" != "--" ]; do extra+=("$1"); shift; done; shift
  log "== $name (limit $lim s): $*"
  "${SUM[@]}" set "$OUT/summary.json" "$name" running
  local t0; t0=$(now)
  timeout -k 5 "$lim" "$@"; local rc=$?
  "${SUM[@]}" done "$OUT/summary.json" "$name" "$rc" "$(since "$t0")" "${extra[@]}"
  return $rc
}

# -- rehearsal only: a venv of torch and numpy alone (made once, then reused: it is never installed into) ------
if [ "$MODE" = rehearse ]; then
  VENV=${REHEARSE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/megatrain/rehearse-venv-$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')}
  PY=$VENV/bin/python MADE="reused"
  if ! { [ -x "$PY" ] && "$PY" -c 'import torch, numpy' 2>/dev/null; }; then
    # the one step that may use the registry (or pip's cache); torch's own dependencies come with it
    stage venv -- bash -c 'rm -rf "$1" && python3 -m venv "$1" && "$1/bin/python" -m pip install -q "torch==$2" numpy' \
      _ "$VENV" "${REHEARSE_TORCH:-2.13.0}" || finish 3
    MADE="made"
  fi
  extra=$("$PY" -c 'import importlib.util as u; print(" ".join(m for m in ("pydantic", "pytest", "deepspeed", "rich") if u.find_spec(m)))')
  if [ -n "$extra" ]; then
    "${SUM[@]}" set "$OUT/summary.json" venv "failed: $VENV is not a venv of torch and numpy alone (it has $extra)"
    finish 3
  fi
  "${SUM[@]}" set "$OUT/summary.json" venv "rehearsed: $VENV ($MADE) holds torch and numpy alone" \
    $([ "$MADE" = reused ] && echo --seconds 0)
  export PIP_NO_INDEX=1  # from here on, as on the device: nothing but the bundle
fi

# -- install: the tree and the bundle into a site folder on PYTHONPATH; Python runs with -P (no cwd on sys.path)
SITE=$WORK/site
stage install -- "$PY" "$ROOT/benchmarks/gpu/install_offline.py" --site "$SITE" --bundle "$BUNDLE" --tests --peers \
  --gpu-file "$WORK/gpu.txt" || finish 3
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
cd "$ROOT"
GPU=$(cat "$WORK/gpu.txt")
if [ -z "$GPU" ]; then
  log "no GPU visible (torch.cuda.is_available() is False): nothing tested or measured"
  for s in "${STAGES[@]}"; do
    [ "$s" = bundle ] || [ "$s" = install ] || [ "$s" = venv ] || "${SUM[@]}" set "$OUT/summary.json" "$s" "no gpu"
  done
  finish 2
fi
log "$GPU"

# -- the optional stages, last: in what is left of the run's budget, skipped when that is short -----------------
time_left() {
  python3 -S -c 'import sys, time; print(int(float(sys.argv[1]) - (time.time() - float(sys.argv[2]))))' \
    "$RUN_BUDGET_S" "$RUN_T0"
}
streamed_stage() {  # the headline with every unit streamed: what the residency pass's choice gained, measured
  local left cap; cap=$(limit headline-streamed) left=$(time_left)
  if [ "$left" -lt "$STREAMED_MIN_S" ]; then
    "${SUM[@]}" set "$OUT/summary.json" headline-streamed \
      "skipped: $left s left of the run's $RUN_BUDGET_S s, the stage needs $STREAMED_MIN_S" --seconds 0
    return 0
  fi
  [ "$((left - 10))" -lt "$cap" ] && cap=$((left - 10))
  stage headline-streamed --limit "$cap" --rows "$ROWS" -- "$PY" -P benchmarks/gpu_step.py --models "$HEADLINE" \
    --stage headline-streamed --resident none --steps "$STEPS" "${CASE_ARGS[@]}"
}
depth_stage() {
  local left cap; cap=$(limit depth-throughput) left=$(time_left)
  if [ "$left" -lt "$DEPTH_MIN_S" ]; then
    "${SUM[@]}" set "$OUT/summary.json" depth-throughput \
      "skipped: $left s left of the run's $RUN_BUDGET_S s, the stage needs $DEPTH_MIN_S (run.sh --depth-only runs it)" \
      --seconds 0
    return 0
  fi
  [ "$((left - 10))" -lt "$cap" ] && cap=$((left - 10))
  stage depth-throughput --limit "$cap" --json "$OUT/depth_throughput.json" -- "$PY" -P benchmarks/depth_throughput.py \
    "${DEPTH_ARGS[@]}" --budget-s "$((cap - 20))" --out "$OUT/depth_throughput.json"
}
[ "$DEPTH_ONLY" -eq 1 ] && { depth_stage; finish; }

# -- preflight: the machine measured, as the profile the cases plan with --------------------------------------
if [ "$TESTS_ONLY" -eq 0 ]; then
  HOST_ARGS=() CASE_HOST=(); [ -n "${HOST_MEM:-}" ] && HOST_ARGS=(--host-mem "$HOST_MEM")
  stage preflight -- "$PY" -P benchmarks/gpu/preflight.py --profile "$OUT/hardware.json" --json "$OUT/preflight.json" \
    --peer-limit-s "$(limit peer)" "${HOST_ARGS[@]}" $([ "$MODE" = rehearse ] && echo --quick)
  pf() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get(sys.argv[2], ""))' "$OUT/preflight.json" "$1" 2>/dev/null; }
  if [ -s "$OUT/hardware.json" ]; then
    HARDWARE=$OUT/hardware.json
    # the Trainer checks its plan against this figure, not the MemAvailable of a machine that grows its memory
    export MEGATRAIN_HOST_MEM=$(pf host_memory_bytes)
    GPU_MEM=${GPU_MEM:-$(pf gpu_budget_bytes)} PEER_CASE=${PEER_CASE:-$(pf peer_case)}
    log "peer case $PEER_CASE: $(pf peer_case_why)"
  else  # no preflight: the nominal preset, the kind's host memory, a 60 GiB budget (fits either kind)
    HARDWARE=h200 GPU_MEM=${GPU_MEM:-60GiB} PEER_CASE=${PEER_CASE:-llama2-7b:4@4096}
    export MEGATRAIN_HOST_MEM=${HOST_MEM:-120GiB}
    CASE_HOST=(--host-mem "$MEGATRAIN_HOST_MEM")
  fi

  # DeepSpeed's CPU Adam, built while the CUDA tests run (the DeepSpeed runs load it from here)
  export TORCH_EXTENSIONS_DIR=$WORK/torch_extensions DS_CPU_ADAM=$WORK/ds_cpu_adam.txt
  DS_PID="" DS_T0=$(now)
  if [ "$SHORT" -eq 1 ]; then
    echo "not built: the short rehearsal (--short) leaves the build to the full one" > "$DS_CPU_ADAM"
  else
    timeout -k 5 "$(limit ds-cpu-adam)" "$PY" -P benchmarks/gpu/peers.py --build-cpu-adam --status "$DS_CPU_ADAM" &
    DS_PID=$!
  fi
fi

# -- the CUDA tests: every one (no -x), each under pytest-timeout, each named in the log as it ends (-v); the
# session stops itself 10 s before the stage's limit where pytest-timeout can (2.3+), so its junit is written
CUDA_TEST_FILES=(tests/runtime/test_cuda.py tests/runtime/test_cuda_long.py tests/runtime/test_device.py
  tests/runtime/test_distributed.py tests/runtime/test_fake_cuda.py tests/runtime/test_fake_cuda_edges.py
  tests/runtime/test_resident.py tests/runtime/test_streamed_checkpoints.py tests/runtime/test_streamed_resume.py)
SESSION=()
"$PY" -P -c 'import inspect, pytest_timeout, sys; sys.exit("session_timeout" not in inspect.getsource(pytest_timeout))' \
  2>/dev/null && SESSION=(--session-timeout "$(($(limit cuda-tests) - 10))")
stage cuda-tests --junit "$OUT/cuda_tests.xml" -- env MEGATRAIN_REQUIRE_CUDA=1 "$PY" -P -m pytest -m cuda -v -rfE \
  -p no:cacheprovider --timeout "$TEST_TIMEOUT" "${SESSION[@]}" --junitxml "$OUT/cuda_tests.xml" "${TEST_SELECT[@]}" \
  "${CUDA_TEST_FILES[@]}"
[ "$TESTS_ONLY" -eq 1 ] && finish

# -- the headline: llama3-8b at 8192 tokens -----------------------------------------------------------------
CASE_ARGS=(--hardware "$HARDWARE" --gpu-mem "$GPU_MEM" "${CASE_HOST[@]}" --out "$ROWS")
stage headline --rows "$ROWS" -- "$PY" -P benchmarks/gpu_step.py --models "$HEADLINE" --stage headline \
  --steps "$STEPS" "${CASE_ARGS[@]}"

# -- the peers, interleaved with megatrain on the same case --------------------------------------------------
ds_built() {  # the DeepSpeed build's stage, once, before the first DeepSpeed run
  [ -n "${DS_DONE:-}" ] && return
  DS_DONE=1
  local rc=0 note; [ -z "$DS_PID" ] || { wait "$DS_PID"; rc=$?; }
  # a build cut off wrote nothing: say so where the DeepSpeed rows read it
  [ -s "$DS_CPU_ADAM" ] || echo "cut off at its $(limit ds-cpu-adam) s limit" > "$DS_CPU_ADAM"
  note=$(cat "$DS_CPU_ADAM")
  case "$note" in
    built*) status=$([ "$MODE" = rehearse ] && echo "rehearsed: DeepSpeedCPUAdam $note" || echo "passed: $note") ;;
    "not built: the short"*) status="rehearsed: $note" ;;
    *) status="failed: $note (exit $rc)" ;;
  esac
  "${SUM[@]}" set "$OUT/summary.json" ds-cpu-adam "$status" --seconds "$([ -n "$DS_PID" ] && since "$DS_T0" || echo 0)"
}
for i in "${!PEERS[@]}"; do
  system=${PEERS[$i]} name="peer-$((i + 1))-${PEERS[$i]}"
  if [ "$system" = megatrain ]; then
    stage "$name" --rows "$ROWS" -- "$PY" -P benchmarks/gpu_step.py --models "$PEER_CASE" --stage "$name" \
      --steps "$PEER_STEPS" "${CASE_ARGS[@]}"
    continue
  fi
  [ "$system" = deepspeed ] && ds_built
  # the rehearsal's peers run on the CPU without the fake backend: gloo and DeepSpeed's CPU accelerator
  stage "$name" --rows "$ROWS" -- env $([ "$PEER_DEVICE" = cpu ] && echo -u MEGATRAIN_FAKE_CUDA) \
    "$PY" -P benchmarks/gpu/peers.py --system "$system" --case "$PEER_CASE" --stage "$name" --device "$PEER_DEVICE" \
    --steps "$PEER_STEPS" --cpu-adam-status "$DS_CPU_ADAM" --out "$ROWS"
done

# -- the largest: qwen2.5-14b at 4096 under the host policy that fits ----------------------------------------
stage qwen2.5-14b --rows "$ROWS" -- "$PY" -P benchmarks/gpu_step.py --models "$BIG" --stage qwen2.5-14b \
  --steps "$STEPS" "${BIG_ARGS[@]}" "${CASE_ARGS[@]}"

streamed_stage
stage table -- bash -c '"$0" -P benchmarks/gpu/table.py "$1" --preflight "$2" --gpu "$3" > "$4" && cat "$4"' \
  "$PY" "$ROWS" "$OUT/preflight.json" "$GPU" "$OUT/results.md"
depth_stage
finish
