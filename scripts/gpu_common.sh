# shellcheck shell=bash
# (sourced by the GPU scripts, not run: `bash scripts/gpu_check.sh --help`)
# What scripts/gpu_check.sh and scripts/gpu_train.sh share, sourced by both from the
# repository's root: the environment check, the machine's description in the log, and capped
# steps. Environment: DEVICE (cuda), LIMIT_SCALE (1: each step's cap in seconds is multiplied by
# it; 0 = no caps), SKIP (step names to leave out), ONLY (the only step names to run), SITE (a
# folder of packages put first on PYTHONPATH: where `scripts/offline_bundle.py unpack` installed
# a bundle's wheels and target).

dev=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1
if [ -n "${SITE:-}" ]; then
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export HF_HUB_OFFLINE=1 # a bundle is for a machine without network
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

# usage SCRIPT: print the script's header comment (its documentation) and exit 0
usage() {
  sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$1"
  exit 0
}

# specdraft and its dependencies importable; else install them from the package index (or say
# how, where NO_INSTALL=1 or the install fails)
ensure_installed() {
  if python3 -c "import hydra, omegaconf, transformers, torch, flow" 2>/dev/null; then
    return 0
  fi
  if [ "${NO_INSTALL:-0}" = 1 ]; then
    echo "specdraft is not installed here: run 'bash scripts/install.sh' (with network), or" \
      "unpack an offline bundle and set SITE (scripts/offline_bundle.py)" >&2
    exit 2
  fi
  echo "installing specdraft and its dependencies (bash scripts/install.sh)" | tee -a "$log"
  bash scripts/install.sh >>"$log" 2>&1 || {
    echo "bash scripts/install.sh failed (see $log); without network, use an offline bundle:" \
      "python scripts/offline_bundle.py --help" >&2
    exit 2
  }
}

log_machine() {
  {
    date -u '+%Y-%m-%d %H:%M:%S UTC'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\))'
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  } 2>&1 | tee -a "$log"
}

# step NAME SECONDS CMD...: run CMD capped at SECONDS x LIMIT_SCALE, output to the log
step() {
  local name=$1 scale=${LIMIT_SCALE:-1}
  local limit=$(($2 * scale))
  shift 2
  if [[ " ${SKIP:-} " == *" $name "* ]] || { [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; }; then
    echo "== $name: skipped" | tee -a "$log"
    return 0
  fi
  local cap=(timeout "$limit")
  [ "$limit" -gt 0 ] || cap=()
  echo "== $name ($(date -u +%H:%M:%S) UTC${cap:+, at most $limit s}): $*" | tee -a "$log"
  "${cap[@]}" "$@" >>"$log" 2>>"$out/progress.err"
  local rc=$?
  echo "   rc=$rc ($(date -u +%H:%M:%S) UTC)" | tee -a "$log"
  return $rc
}

# check_step_names SCRIPT: each name in SKIP and ONLY is one of SCRIPT's steps, else one line
# naming it and exit 2 before anything is written (a misspelled ONLY would skip every step)
check_step_names() {
  local known n
  known=$(grep -oE '(^|[[:space:]])step [a-z_0-9]+ [0-9]+' "$1" | awk '{print $2}' | tr '\n' ' ')
  for n in ${SKIP:-} ${ONLY:-}; do
    if [[ " $known " != *" $n "* ]]; then
      echo "$1: SKIP/ONLY: no step named '$n' (steps: ${known% })" >&2
      exit 2
    fi
  done
}

# begin DEFAULT_OUT LOGNAME "$@": --help, the output folder (the first argument, or
# DEFAULT_OUT/<UTC stamp>) and the log in it
begin() {
  local default=$1 logname=$2 script=$3
  shift 3
  case "${1:-}" in -h | --help) usage "$script" ;; -*)
    echo "$script: unknown option $1 (--help)" >&2
    exit 2
    ;;
  esac
  out=${1:-$default/$(date -u +%Y%m%d-%H%M%S)}
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  log="$out/$logname"
  : >>"$log"
}
