#!/usr/bin/env bash
# GPU run book (issue 15): every GPU number foundryx wants, from ONE GPU, in one command.
#
#   bash benchmarks/gpu_runbook.sh [--out FILE] [--quick] [--wheels DIR] [--dry-run] [--wheel-list]
#
# From the repository root of a machine with one NVIDIA or AMD GPU, with the Python that has
# torch and Triton (PYTHON=..., default python3). Steps:
#   [1/5] environment (GPU, driver, CUDA/ROCm, torch, triton, flash-attn, foundryx commit)
#   [2/5] the Triton attention tests, compiled on the GPU at real sizes: pass/fail counts
#   [3/5] attention TFLOP/s table and MPT-1B steps (benchmarks/attention.py)
#   [4/5] MPT-125M/350M/1B tokens/s and MFU, activation checkpointing x compile
#         (benchmarks/train_throughput.py gpu)
#   [5/5] FP8-base fine-tuning memory (issue 12): "not built yet" until its benchmark exists
# A failing step records the tail of its output and the next step runs; the exit code is 1 when
# any step failed. It writes ONE markdown file (default benchmarks/gpu-runbook-<host>-<date>.md)
# to paste into benchmarks/RESULTS.md. --quick: every step at tiny sizes (a smoke run; its
# numbers are not results). --dry-run: print the steps and commands, and check that the files
# they use exist and the flags they pass are accepted; no GPU needed. Without a GPU: exit 2.
#
# Bare machine (only torch, torchvision and Triton installed): when foundryx's dependencies do
# not import, they are installed with `pip install --no-deps --no-index` from the wheel folder
# (--wheels DIR, default wheels/), then foundryx itself (`pip install --no-deps -e .`). Build the
# folder on a machine with internet and the GPU machine's OS, CPU architecture and Python:
#   bash benchmarks/gpu_runbook.sh --wheel-list > wheel-list.txt
#   pip download -d wheels --no-deps -r wheel-list.txt
#   (for another platform add: --python-version 3.11 --platform manylinux2014_x86_64 --only-binary=:all:)
# The list is constraints.txt minus torch, triton, torchvision and nvidia-* (they come with the
# machine's torch build) and ruff and ziglang (lint, AMD cross-compilation). Composer imports
# torchvision: it must be the build matching the machine's torch (torch 2.7.0: torchvision
# 0.22.0 from the same CUDA or ROCm index as torch); a torchvision wheel put in the folder is
# installed with the rest. flash-attn is optional; when it imports, the tables include it.
set -uo pipefail

HERE=$PWD
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PYTHON=${PYTHON:-python3}
HELPER=benchmarks/gpu_runbook/report.py
FP8_BENCH=benchmarks/fp8_base_memory.py  # issue 12 adds it: --out FILE (markdown), --quick
OUT="" WHEELS=wheels QUICK=0 DRY=0 ARGS="$*"

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
abspath() { case $1 in /*) echo "$1" ;; *) echo "$HERE/$1" ;; esac; }
while [ $# -gt 0 ]; do
  case $1 in
    --out | --wheels)
      [ $# -ge 2 ] || { echo "$1 needs a value (see --help)" >&2; exit 2; }
      if [ "$1" = --out ]; then OUT=$(abspath "$2"); else WHEELS=$(abspath "$2"); fi
      shift 2 ;;
    --quick) QUICK=1; shift ;;
    --dry-run) DRY=1; shift ;;
    --wheel-list) grep -v -E -i '^(torch|torchvision|triton|pytorch-triton.*|nvidia-.*|ruff|ziglang)[=<>]' constraints.txt; exit ;;
    -h | --help) usage; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-benchmarks/gpu-runbook-${HOSTNAME:-$(uname -n)}-$(date +%Y-%m-%d).md}
if [ "$DRY" = 1 ]; then WORK="<tmp>"; else WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-runbook.XXXXXX") || exit 2; fi

# The commands of the steps, shared by the run and --dry-run.
TESTS=(tests/test_triton_attention.py tests/test_triton_attention_mpt.py tests/test_attention_select.py)
if [ "$QUICK" = 1 ]; then
  MODELS=(125m) TEST_ARGS=(-q -k "not test_every_combination") TP_ARGS=(--batches 8 --warmup 2)
  ATTN_ARGS=(--seqs 1024 --head-dims 64 --mpt-batch 1) FP8_ARGS=(--quick)
  EST=("about 1 min, 3 if it installs" "about 2 min" "about 2 min" "about 5 min")
else
  MODELS=(125m 350m 1b) TEST_ARGS=(-q) TP_ARGS=(--batches 30 --warmup 10)
  ATTN_ARGS=(--mpt-batch 4) FP8_ARGS=()
  EST=("about 1 min, 3 if it installs" "about 10 min" "about 5 min" "about 30 min")
fi
CMD_TESTS=("$PYTHON" -m pytest "${TEST_ARGS[@]}" -p no:cacheprovider --junit-xml="$WORK/tests.xml" "${TESTS[@]}")
CMD_ATTN=("$PYTHON" benchmarks/attention.py "${ATTN_ARGS[@]}" --out "$WORK/attention.md")
cmd_tp() { CMD_TP=("$PYTHON" benchmarks/train_throughput.py gpu --models "$1" "${TP_ARGS[@]}" --out "$WORK/throughput-$1.json"); }
CMD_FP8=("$PYTHON" "$FP8_BENCH" ${FP8_ARGS[@]+"${FP8_ARGS[@]}"} --out "$WORK/fp8.md")
TITLES=("environment" "Triton attention tests on the GPU" "attention TFLOP/s table"
  "MPT-125M/350M/1B tokens/s and MFU" "FP8-base fine-tuning memory")

# Issue 12 (FP8/low-precision base for fine-tuning) is built when its memory benchmark exists.
has_fp8_base() { [ -f "$FP8_BENCH" ]; }
if has_fp8_base; then EST+=("see $FP8_BENCH"); else EST+=("not built yet, issue 12"); fi
show() { # a command as one readable line
  local a s=""
  for a in "$@"; do case $a in *[[:space:]]*) s+=" '$a'" ;; *) s+=" $a" ;; esac; done
  echo "${s# }"
}
dur() { printf '%d min %02d s' $(($1 / 60)) $(($1 % 60)); }

if [ "$DRY" = 1 ]; then
  echo "dry run: nothing is installed or measured; a run would write $OUT"
  echo "[1/5] ${TITLES[0]} (${EST[0]})"
  echo "  \$ $(show "$PYTHON" "$HELPER" probe)  # when it fails:"
  echo "  \$ $(show "$PYTHON" -m pip install --no-deps --no-index --find-links "$WHEELS" "$WHEELS/*.whl")"
  echo "  \$ $(show "$PYTHON" -m pip install --no-deps --no-index --no-build-isolation -e .)"
  echo "  \$ $(show "$PYTHON" "$HELPER" env)"
  echo "[2/5] ${TITLES[1]} (${EST[1]}; TRITON_INTERPRET unset)"
  echo "  \$ $(show "${CMD_TESTS[@]}")"
  echo "[3/5] ${TITLES[2]} (${EST[2]})"
  echo "  \$ $(show "${CMD_ATTN[@]}")"
  echo "[4/5] ${TITLES[3]} (${EST[3]})"
  for m in "${MODELS[@]}"; do cmd_tp "$m"; echo "  \$ $(show "${CMD_TP[@]}")"; done
  echo "[5/5] ${TITLES[4]} (${EST[4]})"
  if has_fp8_base; then echo "  \$ $(show "${CMD_FP8[@]}")"; else echo "  not built yet: $FP8_BENCH is absent; the step records that"; fi
  n=0 bad=0
  check() { # check DESCRIPTION COMMAND...: one line per check
    n=$((n + 1))
    if "${@:2}" >/dev/null 2>&1; then echo "  ok    $1"; else echo "  FAIL  $1"; bad=$((bad + 1)); fi
  }
  accepts() { # accepts SCRIPT ARG...: every --flag (and the gpu mode, the models) is in SCRIPT --help
    local help a seen=" "
    help=$("$PYTHON" "$1" --help 2>&1) || { check "$1 --help runs" false; return; }
    for a in "${@:2}"; do
      case $seen in *" $a "*) continue ;; esac
      seen+="$a "
      case $a in --* | gpu | 125m | 350m | 1b)
        check "$1 accepts $a" grep -q -E -- "(^|[^[:alnum:]_-])$a([^[:alnum:]_-]|$)" <<<"$help" ;;
      esac
    done
  }
  echo "checks:"
  for f in "$HELPER" constraints.txt pyproject.toml "${TESTS[@]}" benchmarks/attention.py \
    benchmarks/train_throughput.py; do check "file $f exists" test -f "$f"; done
  for m in "${MODELS[@]}"; do check "file yamls/mpt-$m.yaml exists" test -f "yamls/mpt-$m.yaml"; done
  check "$HELPER --help runs" "$PYTHON" "$HELPER" --help
  check "pytest runs and accepts --junit-xml" grep -q -- --junit-xml <<<"$("$PYTHON" -m pytest --help 2>&1)"
  [ "$QUICK" = 0 ] || check "test_every_combination (deselected by --quick) exists" \
    grep -q "def test_every_combination" tests/test_triton_attention.py
  accepts benchmarks/attention.py "${CMD_ATTN[@]:2}"
  cmd_tp "${MODELS[0]}" && accepts benchmarks/train_throughput.py "${CMD_TP[@]:2}" "${MODELS[@]}"
  if has_fp8_base; then accepts "$FP8_BENCH" "${CMD_FP8[@]:2}"; fi
  echo "dry run: $n checks, $bad failed"
  [ "$bad" = 0 ]
  exit
fi

"$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' 2>/dev/null
case $? in
  0) ;;
  3) echo "no CUDA or ROCm GPU visible to torch; this run book needs one" >&2; exit 2 ;;
  *) echo "torch does not import with PYTHON=$PYTHON; this run book needs the Python with torch and Triton" >&2; exit 2 ;;
esac
unset TRITON_INTERPRET # the kernels are compiled for the GPU, not interpreted
export WANDB_MODE=${WANDB_MODE:-disabled}
FAILED=0

step_env() { # $1: the step's markdown; installs missing dependencies first
  local deps rc=0 pkgs=()
  if deps=$("$PYTHON" "$HELPER" probe); then
    deps="all import, nothing installed"
  else
    echo "missing: $deps"
    shopt -s nullglob && pkgs=("$WHEELS"/*.whl "$WHEELS"/*.tar.gz "$WHEELS"/*.zip) && shopt -u nullglob
    if [ ${#pkgs[@]} -gt 0 ]; then
      "$PYTHON" -m pip install --no-deps --no-index --find-links "$WHEELS" "${pkgs[@]}"
      [[ $("$PYTHON" "$HELPER" probe) != *"foundryx ("* ]] ||
        { "$PYTHON" -m pip install --no-deps --no-index --no-build-isolation -e . && rm -rf foundryx.egg-info; }
      if deps=$("$PYTHON" "$HELPER" probe); then deps="installed from $WHEELS"; else deps="**still missing after installing from $WHEELS: $deps**"; rc=1; fi
    else
      deps="**missing: $deps; no wheel folder $WHEELS (see the head of benchmarks/gpu_runbook.sh)**"; rc=1
    fi
  fi
  "$PYTHON" "$HELPER" env >"$1" || rc=1
  echo "- Dependencies: $deps" >>"$1"
  return $rc
}

step_tests() {
  local rc
  "${CMD_TESTS[@]}"; rc=$?
  { echo "Command: \`$(show "${CMD_TESTS[@]/--junit-xml=*/--junit-xml=FILE}")\`"; echo
    "$PYTHON" "$HELPER" junit "$WORK/tests.xml"; } >"$1"
  return $rc
}

step_attention() {
  "${CMD_ATTN[@]}" || return
  sed -e '/^## Attention kernels on /d' -e "s|--out $WORK/attention.md|--out FILE|" "$WORK/attention.md" |
    sed '/./,$!d' >"$1" # without attention.py's heading and the blank lines before its text
  if grep -q "wrong (max error" "$1"; then
    echo "**A kernel's output disagreed with SDPA** (cells marked wrong)." >>"$1"; return 1
  fi
}

step_throughput() { # one run per model: a model that fails (out of memory) leaves the others
  local m rc=0 ok=() failed="$WORK/throughput-failed.md"
  : >"$failed"
  for m in "${MODELS[@]}"; do
    cmd_tp "$m"
    if "${CMD_TP[@]}" 2>&1 | tee "$WORK/throughput-$m.log"; then ok+=("$WORK/throughput-$m.json"); else
      rc=1
      { echo; echo "MPT-${m^^} failed; the last lines of its output:"; echo; echo '```text'
        tail -n 20 "$WORK/throughput-$m.log"; echo '```'; } >>"$failed"
    fi
  done
  { echo "Command per model: \`$(cmd_tp MODEL; show "${CMD_TP[@]:0:${#CMD_TP[@]}-2}")\`"; echo
    "$PYTHON" "$HELPER" throughput ${ok[@]+"${ok[@]}"}; echo
    echo "Random tokens, seq 2048, bf16 (amp_bf16), one process, attn_impl of the yamls (torch)."
    echo "MFU is n/a when foundryx/devices.py (the speed monitor's peak table) has no bf16 peak for this GPU."
    cat "$failed"; } >"$1"
  return $rc
}

step_fp8() {
  if ! has_fp8_base; then
    echo "Not built yet: issue 12 (FP8/low-precision base for fine-tuning) has not added $FP8_BENCH, so nothing was measured." >"$1"
    return 0
  fi
  "${CMD_FP8[@]}" || return
  { echo "Command: \`$(show "${CMD_FP8[@]:0:${#CMD_FP8[@]}-1}" FILE)\`"; echo; cat "$WORK/fp8.md"; } >"$1"
}

run_step() { # run_step N FUNCTION: runs it, appends its section to $OUT
  local n=$1 title=${TITLES[$1 - 1]} log="$WORK/step$1.log" body="$WORK/step$1.md" t0=$SECONDS rc status
  echo "[$n/5] $title ... (${EST[$n - 1]}; log: $log)" >&2
  : >"$body"
  "$2" "$body" >"$log" 2>&1; rc=$?
  status="ok"
  [ $rc = 0 ] || { status="FAILED (exit $rc)"; FAILED=$((FAILED + 1)); }
  status+=", $(dur $((SECONDS - t0)))"
  { echo; echo "### $n. $title: $status"; echo; cat "$body"
    if [ $rc != 0 ] && ! grep -q '^```text' "$body"; then
      echo; echo "The last lines of its output:"; echo; echo '```text'; tail -n 40 "$log"; echo '```'
    fi; } >>"$OUT"
  echo "[$n/5] $title: $status" >&2
}

mkdir -p "$(dirname "$OUT")"
{ echo "## GPU run book on ${HOSTNAME:-$(uname -n)}, $(date +%Y-%m-%d) (issue 15)"; echo
  echo "Command: \`bash benchmarks/gpu_runbook.sh${ARGS:+ $ARGS}\`"
  [ "$QUICK" = 0 ] || { echo; echo "**--quick smoke run: tiny sizes; its numbers are not results.**"; }
} >"$OUT"
run_step 1 step_env
run_step 2 step_tests
run_step 3 step_attention
run_step 4 step_throughput
run_step 5 step_fp8
{ echo; echo "Steps failed: $FAILED of 5."; } >>"$OUT"
echo "wrote $OUT ($FAILED of 5 steps failed; logs in $WORK)" >&2
[ "$FAILED" = 0 ]
