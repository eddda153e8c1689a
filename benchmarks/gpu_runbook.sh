#!/usr/bin/env bash
# GPU run book v2 (issues 15, 36): the flagship path and every GPU number foundryx wants, from
# ONE GPU, in one command, in at most 8 min 20 s.
#
#   bash benchmarks/gpu_runbook.sh [--out FILE] [--quick] [--only N,N] [--wheels DIR] [--venv DIR] [--dry-run]
#   bash benchmarks/gpu_runbook.sh --wheel-list [--torch VERSION]   # the wheel folder's pins
#   bash benchmarks/gpu_runbook.sh --install-only [--wheels DIR]    # step 1 alone, no GPU needed
#
# From the repository root of a machine with one NVIDIA or AMD GPU (an H100 or MI300X: the 8B
# model's runs need at most 38 GiB of GPU memory and 12 GiB of host memory by `foundryx plan`,
# and its files 16 GB of disk under ~/.cache/foundryx-bench), with the Python that has torch
# and Triton (PYTHON=..., default python3). Steps, in order of value, each under its own time
# limit (`timeout`; RUNBOOK_LIMITS="90 230 30 60 40 50 360" sets them; --only 1,2,6 runs
# those steps alone; the default, steps 1-6, has limits adding up to 500 s, and the dry run
# checks that the chosen steps' limits fit 500 s: step 7 goes with step 1, `--only 1,7`, 450 s,
# in a loan of its own), with the time each is expected to take on an H100
# (estimates; the first H100 run, 2026-11-27, measured step 1 at 60 s and step 5 at 37 s):
#   [1/10] environment (GPU, driver, CUDA/ROCm, torch, triton, flash-attn, foundryx commit);
#         installs from the wheel folder when foundryx's dependencies do not import    90 s: ~15 s, ~60 s installing
#   [2/10] the flagship path (benchmarks/flagship.py): a Llama-3.1-8B-shaped model, random bf16
#         weights written once as 4 safetensors files (16 GB, kept for later runs), read shard
#         by shard and LoRA-trained 3 steps (4096 tokens x 2) over a bf16, an FP8 and an NF4
#         frozen base, offload 0 and 0.5: tokens/s, peak GPU and host memory against
#         `foundryx plan`'s figures, load GB/s                                         230 s: ~30 s writing + 6 x ~30 s
#   [3/10] one ICL eval (the quickstart tasks, a tiny model) on the GPU and on the CPU: the same
#         scores (benchmarks/gpu_runbook/icl.py)                                         30 s: ~26 s
#   [4/10] the Triton kernels' tests compiled on the GPU: attention at its larger GPU sizes (the
#         64-case combination sweep left out: run pytest tests/test_triton_attention.py for it),
#         the FP8 row quantization's bits against torch's ops (tests/test_fp8_rows.py), and the
#         fused RMS norm, SwiGLU and RoPE kernels against float64 (tests/test_fused_ops.py), the
#         NF4 decoding kernel's bits against torchao's (tests/test_nf4_dequant.py)     60 s: ~45 s
#   [5/10] attention TFLOP/s, Triton vs SDPA (and flash-attn when it imports), seq 4096, head dim
#         128 (benchmarks/attention.py)                                                  40 s: 37 s
#         RUNBOOK_BWD="split atomic" times the Triton kernel once per backward (attention.py --bwd;
#         issue 47: which one tuning.py's BWD row should name); it takes longer: raise step 5's
#         limit with RUNBOOK_LIMITS and run it in a loan of its own, e.g. --only 1,5
#   [6/10] MPT-1B tokens/s and MFU, eager, no activation checkpointing (benchmarks/
#         train_throughput.py gpu; the other settings and sizes: run it without --settings) 50 s: ~30 s
#   [7/10] foundryx against plain transformers + peft, side by side (issue 46; not in the
#         default set: --only 1,7): the 8B LoRA over a bf16 base, the peer (benchmarks/
#         peer_lora.py) and foundryx with compile off: the recipe as it is (activation
#         checkpointing auto: selective where it fits) and foundryx-full (every layer
#         recomputed, as the peer: memory for memory), alternating, two rounds, 5 steps each,
#         on the machine's own transformers 5.x (its site-packages put first); tokens/s and
#         peak memory, the ratios foundryx / peer, and one profiled step per side (top kernels,
#         memory breakdown) in <out>-profiles/, a few KB per file
#         (benchmarks/flagship_vs_peer.py)                                    360 s: ~30 s writing + 6 x ~30-50 s
#         RUNBOOK_SIDES and RUNBOOK_ROUNDS pick its sides and rounds (default
#         peer,foundryx,foundryx-full and 2; foundryx-unfused: without issue 51's fused path,
#         measured on an H200 2026-11-29; foundryx-compile: the recipe's compile: auto)
#   Issue 47's steps, not in the default set either: `--only 1,8,9` (480 s) and `--only 1,10` (390 s):
#   [8/10] attn_impl auto's table for this GPU (benchmarks.attention --table): Triton vs SDPA
#         (and flash-attn) fwd and fwd+bwd, seq 2048, head dims 64 and 128, one document / packed /
#         ALiBi / both, causal, MHA and GQA: the rows as JSON in the report, to apply with
#         `python -m benchmarks.attention --apply-table rows.json`                  150 s: ~2 min
#   [9/10] MPT-1B compiled: no AC, selective AC, float8 rowwise and tensorwise (torchao): tokens/s
#         and MFU (the 50% and 1.2x targets), the last step of each profiled (top 25 kernels,
#         text + JSON in <out>-mfu-profiles/) (benchmarks/train_throughput.py gpu)   240 s: 4 x ~55 s
#   [10/10] the MFU table's smaller models: MPT-125M and 350M x {eager, compiled, AC every block
#         compiled, selective AC compiled} (the 1B's eager and AC rows: run train_throughput.py
#         gpu --models 1b without --settings, ~8 min, in a loan of its own)            300 s: 8 x ~35 s
# A failing or timed-out step records the tail of its output and the next step runs; the exit
# code is 1 when any step failed. It writes ONE markdown file (default benchmarks/gpu-runbook-
# <host>-<date>.md) to paste into benchmarks/RESULTS.md. --quick: every step at tiny sizes (a
# smoke run; its numbers are not results). --dry-run: print the steps and commands, and check
# that the files they use exist and the flags they pass are accepted; no GPU needed (CI runs
# it: tests/test_gpu_runbook.py). Without a GPU: exit 2.
#
# Bare machine (Python 3.12 with torch 2.11 + Triton 3.6, transformers 5.17, peft and
# safetensors preinstalled, nothing downloadable): when the run book's imports fail or a
# version is outside foundryx's bounds (transformers 5: foundryx is tested with 4.57), step 1
# makes its own venv (--venv DIR, default ~/.cache/foundryx-bench/gpu-runbook-venv) that sees
# the machine's packages behind its own (a .pth adds the machine Python's site-packages; the
# machine's environment is not changed), installs every file of the wheel folder into it with
# `pip install --no-deps --no-index` (--wheels DIR, default wheels/), then foundryx itself
# (editable), and runs every later step with that venv's Python. A later run reuses the venv.
# Build the folder on a machine with internet, for the GPU machine's Python and platform:
#   bash benchmarks/gpu_runbook.sh --wheel-list --torch 2.11.0 > wheel-list.txt
#   pip download -d wheels --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -r wheel-list.txt
# The list (benchmarks/gpu_runbook/wheels.txt names the packages, constraints.txt pins them):
# what the steps import that such a machine lacks (found by installing over one, see
# wheels.txt), foundryx's tested transformers stack (transformers 4.57.6, tokenizers,
# huggingface_hub, requests, peft, accelerate) over the machine's transformers 5, and the
# torchvision that matches the machine's torch (Composer imports it; 0.N+15 for torch 2.N: 0.26.0
# for 2.11, from the index the machine's torch came from; PyPI's builds match PyPI's torch). Not
# in it: torch, triton, safetensors, numpy and the rest that comes with them (wheels.txt lists
# them). Measured 2026-11-27 with the two commands above (x86_64, Python 3.12, torch 2.11.0,
# pip 26.3), for the H100 image that has torchvision (left out of the folder: step 1 keeps a
# machine's own): 45 files, 39.8 MB (`du -sb wheels`: 39,802,197 bytes; transformers 12.0 MB,
# pillow 7.6, tokenizers 3.3, torchao 3.2, cramjam 2.0, zstd 1.8, the other 39 under 1.5 MB
# each); the limit is 60 MB. flash-attn is optional; when it imports, step 5 includes it.
set -uo pipefail

HERE=$PWD
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PYTHON=${PYTHON:-python3}
MACHINE_PYTHON=$PYTHON
# the steps' Python modules, each run from the checkout as `python -m <module>`
HELPER=benchmarks.gpu_runbook.report
ICL=benchmarks.gpu_runbook.icl
FLAGSHIP=benchmarks.flagship
VS_PEER=benchmarks.flagship_vs_peer
WHEEL_NAMES=benchmarks/gpu_runbook/wheels.txt
OUT="" WHEELS=wheels QUICK=0 DRY=0 INSTALL_ONLY=0 TORCH=2.11.0 ONLY=1,2,3,4,5,6 ARGS="$*" # step 7: --only 1,7
VENV=${XDG_CACHE_HOME:-$HOME/.cache}/foundryx-bench/gpu-runbook-venv
N=10 BUDGET=500

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
abspath() { case $1 in /*) echo "$1" ;; *) echo "$HERE/$1" ;; esac; }
wheel_list() { # the pins of wheels.txt's names from constraints.txt, and torchvision for --torch
  local name pin minor rest bad=0
  while read -r name; do
    case $name in *==*) echo "$name"; continue ;; esac # pinned in wheels.txt itself
    pin=$(grep -i -m1 -E "^${name//./\\.}==" constraints.txt) ||
      { echo "wheel list: $name (benchmarks/gpu_runbook/wheels.txt) has no pin in constraints.txt" >&2; bad=1; continue; }
    echo "$pin"
  done < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$WHEEL_NAMES")
  if [[ $TORCH =~ ^2\.([0-9]+)(\.[0-9]+)?$ ]]; then
    minor=${BASH_REMATCH[1]} rest=${BASH_REMATCH[2]:-.0}
    echo "torchvision==0.$((minor + 15))$rest"
  else
    echo "wheel list: --torch $TORCH is not a torch 2.N[.P] version" >&2; bad=1
  fi
  return $bad
}
while [ $# -gt 0 ]; do
  case $1 in
    --out | --wheels | --venv | --torch | --only)
      [ $# -ge 2 ] || { echo "$1 needs a value (see --help)" >&2; exit 2; }
      case $1 in
        --out) OUT=$(abspath "$2") ;; --wheels) WHEELS=$(abspath "$2") ;;
        --venv) VENV=$(abspath "$2") ;; --torch) TORCH=$2 ;; --only) ONLY=$2 ;;
      esac
      shift 2 ;;
    --quick) QUICK=1; shift ;;
    --dry-run) DRY=1; shift ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    --wheel-list) LIST=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ "${LIST:-0}" = 1 ]; then wheel_list; exit; fi
[[ $ONLY =~ ^([1-9]|10)(,([1-9]|10))*$ ]] || { echo "--only $ONLY: step numbers 1-10, comma-separated" >&2; exit 2; }
OUT=${OUT:-benchmarks/gpu-runbook-${HOSTNAME:-$(uname -n)}-$(date +%Y-%m-%d).md}
if [ "$DRY" = 1 ]; then WORK="<tmp>"; else WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-runbook.XXXXXX") || exit 2; fi

read -r -a LIMITS <<<"${RUNBOOK_LIMITS:-90 230 30 60 40 50 360 150 240 300}"
[ ${#LIMITS[@]} = $N ] || { echo "RUNBOOK_LIMITS: $N numbers of seconds, one per step" >&2; exit 2; }
TOTAL=0; for i in "${!LIMITS[@]}"; do [[ ,$ONLY, != *,$((i + 1)),* ]] || TOTAL=$((TOTAL + LIMITS[i])); done # the chosen steps'
TITLES=("environment" "flagship: Llama-3.1-8B shape, LoRA over bf16 / FP8 / NF4 bases, offload 0 / 0.5"
  "ICL eval on the GPU against the CPU" "Triton kernel tests on the GPU" "attention TFLOP/s table"
  "MPT-1B tokens/s and MFU" "foundryx vs plain transformers + peft: 8B LoRA, bf16 base, side by side, profiled"
  "attn_impl auto's attention table for this GPU" "MPT-1B compiled: no AC, selective AC, float8; one step profiled"
  "MFU table: MPT-125M and 350M, eager / compiled / AC / selective AC")
TESTS=(tests/test_triton_attention.py tests/test_triton_attention_mpt.py tests/test_attention_select.py
  tests/test_attention_flex.py
  tests/test_fp8_rows.py tests/test_fused_ops.py tests/test_nf4_dequant.py)
if [ "$QUICK" = 1 ]; then
  SHAPE=benchmarks/gpu_runbook/shapes/llama-tiny STEPS=2 MODEL=125m TP_ARGS=(--batches 8 --warmup 2)
  ATTN_ARGS=(--seqs 1024 --head-dims 64 --no-mpt)
  EST=("~15 s" "~1 min" "~20 s" "~45 s" "~20 s" "~25 s" "~2 min")
  TITLES[1]="flagship path at a tiny Llama shape"; TITLES[5]="MPT-125M tokens/s and MFU"
  TITLES[6]="foundryx vs plain transformers + peft at a tiny Llama shape" PEER_STEPS=3
  TABLE_ARGS=(--seqs 1024 --head-dims 64) MFU_ARGS=(--models 125m --settings compile fp8-rowwise
    --batches 8 --warmup 2) SIZES_ARGS=(--models 125m --settings eager sel-compile --batches 8 --warmup 2)
  EST+=("~40 s" "~1 min" "~1 min") TITLES[8]="MPT-125M compiled and float8; one step profiled"
else
  SHAPE=yamls/shapes/llama-3.1-8b STEPS=3 MODEL=1b TP_ARGS=(--batches 15 --warmup 5)
  ATTN_ARGS=(--seqs 4096 --head-dims 128 --no-mpt)
  EST=("~15 s, ~60 s installing" "~3.5 min" "~26 s" "~45 s" "37 s" "~30 s" "~5 min") PEER_STEPS=5
  TABLE_ARGS=(--seqs 2048 --head-dims 64 128) MFU_ARGS=(--models 1b --settings compile sel-compile
    fp8-rowwise fp8-tensorwise --batches 12 --warmup 4) SIZES_ARGS=(--models 125m 350m --settings
    eager compile ac-compile sel-compile --batches 12 --warmup 4)
  EST+=("~2 min" "4 x ~55 s" "8 x ~35 s")
fi

if [ -n "${RUNBOOK_BWD:-}" ]; then read -r -a BWD_MODES <<<"$RUNBOOK_BWD"; ATTN_ARGS+=(--bwd "${BWD_MODES[@]}"); fi
commands() { # the steps' commands, shared by the run and --dry-run; again once step 1 picks PYTHON
  CMD_FLAGSHIP=("$PYTHON" -m "$FLAGSHIP" --device cuda --shape "$SHAPE" --bases bf16,fp8,nf4
    --offload 0,0.5 --steps "$STEPS" --time-limit $((LIMITS[1] > 20 ? LIMITS[1] - 10 : LIMITS[1]))
    --run-timeout 90 --logs "$WORK/flagship" --out "$WORK/flagship.md")
  CMD_ICL=("$PYTHON" -m "$ICL" --out "$WORK/icl.md")
  CMD_TESTS=("$PYTHON" -m pytest -q -k "not test_every_combination" -p no:cacheprovider
    --junit-xml="$WORK/tests.xml" "${TESTS[@]}")
  CMD_ATTN=("$PYTHON" -m benchmarks.attention "${ATTN_ARGS[@]}" --out "$WORK/attention.md")
  CMD_TP=("$PYTHON" -m benchmarks.train_throughput gpu --models "$MODEL" --settings eager
    "${TP_ARGS[@]}" --out "$WORK/throughput.json")
  CMD_VS_PEER=("$PYTHON" -m "$VS_PEER" --device cuda --shape "$SHAPE" --rounds "${RUNBOOK_ROUNDS:-2}"
    --steps "$PEER_STEPS" --sides "${RUNBOOK_SIDES:-peer,foundryx,foundryx-full}"
    --time-limit $((LIMITS[6] > 20 ? LIMITS[6] - 10 : LIMITS[6])) --run-timeout 150
    --logs "$WORK/vs-peer" --profiles "${OUT%.md}-profiles" --json "$WORK/vs-peer.json"
    --out "$WORK/vs-peer.md")
  CMD_TABLE=("$PYTHON" -m benchmarks.attention "${TABLE_ARGS[@]}" --table "$WORK/attention-table.json"
    --out "$WORK/attention-table.md")
  CMD_MFU=("$PYTHON" -m benchmarks.train_throughput gpu "${MFU_ARGS[@]}" --profile "${OUT%.md}-mfu-profiles"
    --out "$WORK/mfu.json")
  CMD_SIZES=("$PYTHON" -m benchmarks.train_throughput gpu "${SIZES_ARGS[@]}" --out "$WORK/sizes.json")
}
commands
show() { # a command as one readable line
  local a s=""
  for a in "$@"; do case $a in *[[:space:]]*) s+=" '$a'" ;; *) s+=" $a" ;; esac; done
  echo "${s# }"
}
dur() { printf '%d min %02d s' $(($1 / 60)) $(($1 % 60)); }

if [ "$DRY" = 1 ]; then
  echo "dry run: nothing is installed or measured; a run would write $OUT"
  echo "time limits: ${LIMITS[*]} s; steps $ONLY: $TOTAL s in all"
  step_head() { echo "[$1/$N] ${TITLES[$1 - 1]} (limit ${LIMITS[$1 - 1]} s; ${EST[$1 - 1]})"; }
  step_head 1
  echo "  \$ $(show "$PYTHON" -m "$HELPER" probe)  # when it fails (or $VENV/bin/python's, when that venv exists):"
  echo "  \$ $(show "$PYTHON" -m venv --without-pip "$VENV")"
  echo "  \$ $(show "$VENV/bin/python" -m "$HELPER" machine-pth) \$($(show "$PYTHON" -m "$HELPER" sites))"
  echo "  \$ $(show "$VENV/bin/python" -m pip install --no-deps --no-index --no-compile --find-links "$WHEELS" "$WHEELS/*")"
  echo "  \$ $(show "$VENV/bin/python" -m pip install --no-deps --no-index --no-build-isolation -e .)"
  echo "  \$ $(show "$PYTHON" -m "$HELPER" env)  # with the venv's Python when it was made"
  step_head 2; echo "  \$ $(show "${CMD_FLAGSHIP[@]}")"
  step_head 3; echo "  \$ $(show "${CMD_ICL[@]}")"
  step_head 4; echo "  \$ $(show "${CMD_TESTS[@]}")  # TRITON_INTERPRET unset"
  step_head 5; echo "  \$ $(show "${CMD_ATTN[@]}")"
  step_head 6; echo "  \$ $(show "${CMD_TP[@]}")"
  step_head 7; echo "  \$ $(show "${CMD_VS_PEER[@]}")  # PYTHONPATH: $MACHINE_PYTHON's site-packages first when the run book's venv runs"
  step_head 8; echo "  \$ $(show "${CMD_TABLE[@]}")"
  step_head 9; echo "  \$ $(show "${CMD_MFU[@]}")"
  step_head 10; echo "  \$ $(show "${CMD_SIZES[@]}")"
  n=0 bad=0
  check() { # check DESCRIPTION COMMAND...: one line per check
    n=$((n + 1))
    if "${@:2}" >/dev/null 2>&1; then echo "  ok    $1"; else echo "  FAIL  $1"; bad=$((bad + 1)); fi
  }
  file_of() { local m=${1//.//}; echo "$m.py"; } # a module's file: benchmarks.x -> benchmarks/x.py
  accepts() { # accepts MODULE ARG...: every --flag (and the gpu mode, models, settings) is in MODULE --help
    local help a seen=" "
    help=$("$PYTHON" -m "$1" --help 2>&1) || { check "$1 --help runs" false; return; }
    for a in "${@:2}"; do
      case $seen in *" $a "*) continue ;; esac
      seen+="$a "
      case $a in --* | gpu | cuda | 125m | 350m | 1b | eager | compile | ac-compile | sel-compile | fp8-rowwise | fp8-tensorwise)
        check "$1 accepts ${a%%=*}" grep -q -E -- "(^|[^[:alnum:]_-])${a%%=*}([^[:alnum:]_-]|$)" <<<"$help" ;;
      esac
    done
  }
  echo "checks:"
  for f in "$(file_of "$HELPER")" "$(file_of "$ICL")" "$(file_of "$FLAGSHIP")" "$(file_of "$VS_PEER")" \
    benchmarks/peer_lora.py benchmarks/instruments/step_profile.py \
    "$WHEEL_NAMES" constraints.txt pyproject.toml "${TESTS[@]}" \
    benchmarks/attention.py benchmarks/train_throughput.py benchmarks/load_memory.py \
    "yamls/mpt-$MODEL.yaml" yamls/finetune/llama-8b-lora-fp8.yaml "$SHAPE/config.json" \
    eval/yamls/quickstart.yaml; do check "file $f exists" test -f "$f"; done
  check "the time limits of steps $ONLY add up to at most $BUDGET s ($TOTAL)" test "$TOTAL" -le "$BUDGET"
  check "timeout (coreutils) is installed" command -v timeout
  check "every name in $WHEEL_NAMES has a pin (--wheel-list)" wheel_list
  check "$HELPER --help runs" "$PYTHON" -m "$HELPER" --help
  check "pytest runs and accepts --junit-xml" grep -q -- --junit-xml <<<"$("$PYTHON" -m pytest --help 2>&1)"
  check "test_every_combination (deselected) exists" grep -q "def test_every_combination" tests/test_triton_attention.py
  accepts "$FLAGSHIP" "${CMD_FLAGSHIP[@]:3}"
  accepts "$ICL" "${CMD_ICL[@]:3}"
  accepts benchmarks.attention "${CMD_ATTN[@]:3}"
  accepts benchmarks.train_throughput "${CMD_TP[@]:3}"
  accepts "$VS_PEER" "${CMD_VS_PEER[@]:3}"
  accepts benchmarks.attention "${CMD_TABLE[@]:3}"
  accepts benchmarks.train_throughput "${CMD_MFU[@]:3}"
  accepts benchmarks.train_throughput "${CMD_SIZES[@]:3}"
  check "yamls/mpt-125m.yaml and yamls/mpt-350m.yaml exist" test -f yamls/mpt-125m.yaml -a -f yamls/mpt-350m.yaml
  check "benchmarks.peer_lora --help runs" "$PYTHON" -m benchmarks.peer_lora --help
  echo "dry run: $n checks, $bad failed"
  [ "$bad" = 0 ]
  exit
fi

limited() { # a command under what is left of the step's limit: exit 124 when it ran out
  local left=$((DEADLINE - SECONDS))
  [ $left -gt 0 ] || { echo "no time left of this step's ${LIMIT} s" >&2; return 124; }
  timeout -k 10 "$left" "$@"
}

install() { # $1: what is missing; makes the venv, installs the wheel folder, sets PYTHON
  local vpy=$VENV/bin/python pkgs=() sites=()
  shopt -s nullglob && pkgs=("$WHEELS"/*.whl "$WHEELS"/*.tar.gz "$WHEELS"/*.zip) && shopt -u nullglob
  if "$PYTHON" -c "import torchvision" 2>/dev/null; then # the machine's, built for its torch
    mapfile -t pkgs < <(printf '%s\n' "${pkgs[@]}" | grep -v -e '/torchvision-' -e '^$')
  fi
  if [ ${#pkgs[@]} = 0 ]; then
    DEPS="**missing: $1; no wheel folder $WHEELS (see the head of benchmarks/gpu_runbook.sh)**"; return 1
  fi
  mapfile -t sites < <(limited "$PYTHON" -m "$HELPER" sites)
  if [ ! -x "$vpy" ]; then
    mkdir -p "$(dirname "$VENV")"
    limited "$PYTHON" -m venv --without-pip "$VENV" ||
      { DEPS="**missing: $1; \`$PYTHON -m venv --without-pip $VENV\` failed**"; return 1; }
  fi
  limited "$vpy" -m "$HELPER" machine-pth "${sites[@]}" &&
    limited "$vpy" -m pip install --no-deps --no-index --no-compile --find-links "$WHEELS" "${pkgs[@]}" ||
    { DEPS="**missing: $1; installing $WHEELS into $VENV failed (is pip installed for $PYTHON? the log has pip's output)**"; return 1; }
  limited "$vpy" -m pip install --no-deps --no-index --no-build-isolation -e . && rm -rf foundryx.egg-info
  if DEPS=$(limited "$vpy" -m "$HELPER" probe); then
    PYTHON=$vpy
    DEPS="installed from $WHEELS (${#pkgs[@]} files) into the run book's venv $VENV, over the packages of $MACHINE_PYTHON"
  else
    DEPS="**still missing after installing from $WHEELS into $VENV: $DEPS**"; return 1
  fi
}

setup_python() { # the Python the steps use (PYTHON), why (DEPS); installs when it must
  local gone
  if [ -x "$VENV/bin/python" ] && gone=$(limited "$VENV/bin/python" -m "$HELPER" probe 2>/dev/null); then
    PYTHON=$VENV/bin/python DEPS="all import in the run book's venv $VENV (made by an earlier run)"
  elif gone=$(limited "$PYTHON" -m "$HELPER" probe); then
    DEPS="all import, nothing installed"
  else
    echo "missing: $gone"
    install "$gone" || return 1
  fi
  commands
}

if [ "$INSTALL_ONLY" = 1 ]; then
  LIMIT=${LIMITS[0]} DEADLINE=$((SECONDS + LIMITS[0]))
  setup_python; rc=$?
  echo "Python: $PYTHON"; echo "Dependencies: $DEPS"
  exit $rc
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

step_env() { # $1: the step's markdown
  local rc=0
  setup_python || rc=1
  limited "$PYTHON" -m "$HELPER" env >"$1" || rc=1
  { echo "- Python: $PYTHON"; echo "- Dependencies: $DEPS"; } >>"$1"
  return $rc
}

step_flagship() {
  local rc
  limited "${CMD_FLAGSHIP[@]}"; rc=$?
  if [ -f "$WORK/flagship.md" ]; then sed "s|$WORK/||g" "$WORK/flagship.md" >"$1"; fi
  if [ $rc = 124 ] || [ $rc = 137 ]; then
    echo; echo "**Stopped at the step's limit of $LIMIT s**: the table has the runs that finished." >>"$1"
  fi
  return $rc
}

step_icl() {
  local rc
  limited "${CMD_ICL[@]}"; rc=$?
  [ ! -f "$WORK/icl.md" ] || cat "$WORK/icl.md" >"$1"
  return $rc
}

step_tests() {
  local rc
  limited "${CMD_TESTS[@]}"; rc=$?
  { echo "Command: \`$(show "${CMD_TESTS[@]/--junit-xml=*/--junit-xml=FILE}")\`"; echo
    "$PYTHON" -m "$HELPER" junit "$WORK/tests.xml"; } >"$1"
  return $rc
}

step_attention() {
  limited "${CMD_ATTN[@]}" || return
  sed -e '/^## Attention kernels on /d' -e "s|--out $WORK/attention.md|--out FILE|" "$WORK/attention.md" |
    sed '/./,$!d' >"$1" # without attention.py's heading and the blank lines before its text
  if grep -q "wrong (max error" "$1"; then
    echo "**A kernel's output disagreed with SDPA** (cells marked wrong)." >>"$1"; return 1
  fi
}

step_throughput() {
  local rc
  limited "${CMD_TP[@]}"; rc=$?
  { echo "Command: \`$(show "${CMD_TP[@]:0:${#CMD_TP[@]}-2}")\`"; echo
    if [ $rc = 0 ]; then "$PYTHON" -m "$HELPER" throughput "$WORK/throughput.json"; echo; fi
    echo "Random tokens, seq 2048, bf16 (amp_bf16), one process, attn_impl of the yamls (torch)."
    echo "MFU is n/a when foundryx/runtime/devices.py (the speed monitor's peak table) has no bf16 peak for this GPU."
  } >"$1"
  return $rc
}

step_vs_peer() { # both sides on the machine's own transformers: its site-packages first
  local rc sites="" dir=${OUT%.md}-profiles
  if [ "$PYTHON" != "$MACHINE_PYTHON" ]; then
    sites=$(limited "$MACHINE_PYTHON" -m "$HELPER" sites | paste -sd: -)
  fi
  rm -rf "$dir"
  limited env PYTHONPATH="$sites${PYTHONPATH:+:$PYTHONPATH}" "${CMD_VS_PEER[@]}"; rc=$?
  if [ -f "$WORK/vs-peer.md" ]; then sed "s|$WORK/||g" "$WORK/vs-peer.md" >"$1"; fi
  { echo; echo "PYTHONPATH first: ${sites:-nothing (the steps run on the machine Python)}."
    [ ! -d "$dir" ] || echo "Profile files in $dir: $(ls "$dir" | paste -sd' ' -)."
  } >>"$1"
  if [ $rc = 124 ] || [ $rc = 137 ]; then
    echo; echo "**Stopped at the step's limit of $LIMIT s**: the table has the runs that finished." >>"$1"
  fi
  return $rc
}

step_table() { # issue 47: attn_impl auto's rows for this GPU, as JSON to apply with --apply-table
  local rc
  limited "${CMD_TABLE[@]}"; rc=$?
  if [ -f "$WORK/attention-table.md" ]; then
    sed -e '/^## Attention kernels on /d' -e "s|$WORK/||g" "$WORK/attention-table.md" | sed '/./,$!d' >"$1"
  fi
  if [ -f "$WORK/attention-table.json" ]; then
    { echo; echo "The rows (save as rows.json, then \`python -m benchmarks.attention --apply-table rows.json\`):"
      echo; echo '```json'; cat "$WORK/attention-table.json"; echo '```'; } >>"$1"
  fi
  if grep -q "wrong (max error" "$1"; then
    echo "**A kernel's output disagreed with SDPA** (cells marked wrong)." >>"$1"; return 1
  fi
  return $rc
}

mfu_report() { # mfu_report JSON CMD...: the throughput table, failed cases, the MFU formula
  { echo "Command: \`$(show "${@:2:$#-3}")\`"; echo
    [ ! -f "$1" ] || { "$PYTHON" -m "$HELPER" throughput "$1"; echo; } # with the failed cases' reasons
    echo "Random tokens, seq 2048, amp_bf16, one process, attn_impl of the yamls (torch), micro-batch"
    echo "125m/350m 16, 1b 8. MFU as the speed monitor counts it: flops_per_batch / batch seconds /"
    echo "peak, flops_per_batch = 3 * b * (2 * N * s + 4 * n_layers * d_model * s^2) (N: matmul"
    echo "parameters), peak: the GPU's dense bf16 FLOP/s (foundryx/runtime/devices.py), float8 rows included."
  }
}

step_mfu() {
  local rc dir=${OUT%.md}-mfu-profiles f
  rm -rf "$dir"
  limited "${CMD_MFU[@]}"; rc=$?
  mfu_report "$WORK/mfu.json" "${CMD_MFU[@]}" >"$1"
  for f in "$dir"/*.txt; do
    [ -f "$f" ] || continue
    { echo; echo "Top kernels of one step, $(basename "$f" .txt) (all of it, and JSON, in $dir):"; echo
      echo '```text'; head -n 16 "$f"; echo '```'; } >>"$1"
  done
  return $rc
}

step_sizes() {
  local rc
  limited "${CMD_SIZES[@]}"; rc=$?
  mfu_report "$WORK/sizes.json" "${CMD_SIZES[@]}" >"$1"
  return $rc
}

run_step() { # run_step N FUNCTION: runs it under its limit, appends its section to $OUT
  local n=$1 title=${TITLES[$1 - 1]} log="$WORK/step$1.log" body="$WORK/step$1.md" t0=$SECONDS rc status
  if [[ ,$ONLY, != *,$n,* ]]; then
    { echo; echo "### $n. $title: skipped (--only $ONLY)"; } >>"$OUT"; return
  fi
  LIMIT=${LIMITS[$n - 1]} DEADLINE=$((SECONDS + LIMITS[$n - 1]))
  echo "[$n/$N] $title ... (limit $LIMIT s, ${EST[$n - 1]}; log: $log)" >&2
  : >"$body"
  "$2" "$body" >"$log" 2>&1; rc=$?
  status="ok"
  if [ $rc = 124 ] || [ $rc = 137 ]; then status="FAILED (timed out at its limit of $LIMIT s)"; FAILED=$((FAILED + 1))
  elif [ $rc != 0 ]; then status="FAILED (exit $rc)"; FAILED=$((FAILED + 1)); fi
  status+=", $(dur $((SECONDS - t0)))"
  { echo; echo "### $n. $title: $status"; echo; cat "$body"
    if [ $rc != 0 ] && ! grep -q '^```text' "$body"; then
      echo; echo "The last lines of its output:"; echo; echo '```text'; tail -n 40 "$log"; echo '```'
    fi; } >>"$OUT"
  echo "[$n/$N] $title: $status" >&2
}

mkdir -p "$(dirname "$OUT")"
{ echo "## GPU run book on ${HOSTNAME:-$(uname -n)}, $(date +%Y-%m-%d) (issues 15, 36)"; echo
  echo "Command: \`bash benchmarks/gpu_runbook.sh${ARGS:+ $ARGS}\` (time limits ${LIMITS[*]} s)"
  [ "$QUICK" = 0 ] || { echo; echo "**--quick smoke run: tiny sizes; its numbers are not results.**"; }
} >"$OUT"
START=$SECONDS
run_step 1 step_env
run_step 2 step_flagship
run_step 3 step_icl
run_step 4 step_tests
run_step 5 step_attention
run_step 6 step_throughput
run_step 7 step_vs_peer
run_step 8 step_table
run_step 9 step_mfu
run_step 10 step_sizes
{ echo; echo "Steps failed: $FAILED of $N. Total $(dur $((SECONDS - START)))."; } >>"$OUT"
echo "wrote $OUT ($FAILED of $N steps failed, $(dur $((SECONDS - START))); logs in $WORK)" >&2
[ "$FAILED" = 0 ]
