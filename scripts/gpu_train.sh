#!/usr/bin/env bash
# Drafts trained on a lent GPU (issue 45), as one prepared recipe sized to the 15 device minutes
# a session has: the target answers a slice of ShareGPT on the GPU, an EAGLE-3 head continues
# training on those answers (from the shipped head, or from an earlier GPU run's weights), is
# measured on MT-bench with the compiled decoder, and comes back in files of at most 16 MiB.
# Here, first:
#   bash scripts/gpu_pack.sh                          # .gpu/p1 p2 p3: the target, the wheels
#   python scripts/gpu_train_pack.py [--skip N] [--init DIR]   # .gpu/t1: prompts (+ weights)
# On the device, four calls back to back (a machine goes back 30 s after a call):
#   run "bash scripts/gpu_train.sh stash"       carry [".gpu/p1"]
#   run "bash scripts/gpu_train.sh stash"       carry [".gpu/p2"]
#   run "bash scripts/gpu_train.sh stash"       carry [".gpu/p3"]
#   run "bash scripts/gpu_train.sh run \$OUT"   carry [".gpu/t1"]   timeout_s 600
# Both device scripts stash into the same place, so on one warm machine they share the parts:
# e.g. "gpu_check.sh exact" carrying .gpu/p1 (the compiled decoder's exactness tests, ~3.5
# min), then "gpu_train.sh stash" with p2 and p3, then this run with REGEN_MIN=2 TRAIN_MIN=3
# PROMPTS=40 (~7.5 min): both issues' checks in one session's 15 minutes.
# Then here: python scripts/gpu_train_unpack.py /work/.device/<n>   # -> runs/gpu/<stamp>/
# (a draft folder: draft=..., or train.init_from=... for the next run: short runs add up).
#
# The last call's steps, each capped (seconds x LIMIT_SCALE); minutes are the budgets the
# programs themselves keep, so each ends cleanly and writes what it did:
#   regen  (REGEN_MIN 2.5 min) specdraft-prepare on the GPU: replies of <= 256 tokens at
#          REGEN_T (0: greedy), prompt and reply <= 768 tokens (at 384, the CPU recipes'
#          length, 38 of the first 82 conversations a CPU dry run reached ran out of room and
#          were dropped), REGEN_BATCH (512) generated together on the batched decoder's
#          static cache and CUDA graphs (REGEN_COMPILE, auto; if that writes nothing, again
#          with compile=false); stops starting conversations at the budget
#   train  (TRAIN_MIN 4 min) specdraft-train experiment=eagle3_smollm2_gpu on those replies
#   eval   (110 s) the new head on MT-bench's first turns (PROMPTS 80 x TOKENS 128), a chain of
#          3 at T = 0 on the compiled decoder: alpha by position, tau, speedup, lossless
#   pack   the draft folder as draft.tar.part_* (<= 15 MiB each), its metrics, a summary with
#          training tokens/s and the model FLOP utilisation (scripts/gpu_train_summary.py)
# DEVICE (cuda), TARGET (the Hydra target group; default the embedded smollm2_135m),
# TARGET_ARGS (more target.* overrides, for all three programs), INIT (the weights to start
# from, in place of slice.json's), EXPERIMENT (eagle3_smollm2_gpu), EXTRA_TRAIN (more train
# overrides) change it. A CPU run of
# the whole recipe (tests/test_gpu_recipe.py runs it with the tiny target):
#   export STASH=/tmp/s SITE=/tmp/site DEVICE=cpu REGEN_MIN=0.2 TRAIN_MIN=0.3 PROMPTS=2 TOKENS=8
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu_common.sh
source scripts/gpu_common.sh
begin "run stash" train.log "$@"

log_machine
target=${TARGET:-smollm2_135m}
# shellcheck disable=SC2206
tgt=("target=$target" "target.device=$dev" ${TARGET_ARGS:-})
if [ "$target" = smollm2_135m ]; then
  assemble_target || exit 2
elif [ ! -d "$site/hydra" ]; then
  python3 -c "import hydra" 2>/dev/null || {
    echo "hydra is not installed: carry .gpu/p1 (scripts/gpu_pack.sh)" | tee -a "$log" >&2
    exit 2
  }
fi
if [ ! -f "$stash/prompts.jsonl.gz" ]; then
  echo "no prompts in $stash: carry .gpu/t1 (scripts/gpu_train_pack.py)" | tee -a "$log" >&2
  exit 2
fi
work=${WORK:-/tmp/specdraft-gpu-work}
rm -rf "$work"
mkdir -p "$work"
gunzip -c "$stash/prompts.jsonl.gz" >"$work/prompts.jsonl"
init=${INIT:-$(python3 -c "import json; print(json.load(open('$stash/slice.json'))['init'])")}
if [ "$init" = carried ]; then
  cat "$stash"/init.tar.part_* | tar -x -C "$work" && init="$work/init"
fi
echo "prompts: $(wc -l <"$work/prompts.jsonl"), init: $init" | tee -a "$log"
regen_min=${REGEN_MIN:-2.5}
train_min=${TRAIN_MIN:-4}
secs() { python3 -c "import math; print(math.ceil(60 * $1 * 1.3 + ${2:-60}))"; }

# on the batched decoder's static cache and CUDA graphs (REGEN_COMPILE, auto); if that writes
# nothing (its first run at 512 rows on a card is the next one), once more on transformers'
# forward, which continues what the first wrote
regen() {
  step "$1" "$(secs "$regen_min")" python3 -m flow.regenerate "${tgt[@]}" \
    "data.path=$work/prompts.jsonl" "out=$work/regen.jsonl" max_turns=1 \
    max_new_tokens=256 data.max_length=768 "temperature=${REGEN_T:-0}" \
    "batch_size=${REGEN_BATCH:-512}" "max_minutes=$regen_min" progress=false "compile=$2"
}
regen regen "${REGEN_COMPILE:-auto}"
if [ ! -s "$work/regen.jsonl" ] && [ "${REGEN_COMPILE:-auto}" != false ]; then
  echo "regeneration wrote nothing: again with compile=false" | tee -a "$log"
  regen regen_hf false
fi
if [ ! -s "$work/regen.jsonl" ]; then
  echo "no replies were regenerated: see $out/progress.err" | tee -a "$log" >&2
  exit 1
fi
# shellcheck disable=SC2086
step train "$(secs "$train_min" 120)" python3 -m flow "experiment=${EXPERIMENT:-eagle3_smollm2_gpu}" \
  "${tgt[@]}" "data.path=$work/regen.jsonl" "train.init_from=$init" \
  "train.max_minutes=$train_min" train.progress=false "output_dir=$work/run" ${EXTRA_TRAIN:-}
if [ ! -d "$work/run/final" ]; then
  echo "training left no final draft: see $out/progress.err" | tee -a "$log" >&2
  exit 1
fi
cp "$work/run/metrics.jsonl" "$out/metrics.jsonl"
step eval 110 python3 -m decoding.eval "draft=$work/run/final" "${tgt[@]}" tree=chain gamma=3 \
  adaptive=false "num_prompts=${PROMPTS:-80}" "max_new_tokens=${TOKENS:-128}" temperature=0 \
  compile=auto "report=$out/eval_chain.json" plot=/tmp/eval_chain.png
tar -c -C "$work/run" final | split -b 15M -d -a 2 - "$out/draft.tar.part_"
python3 scripts/gpu_train_summary.py --run "$work/run" --regen "$work/regen.jsonl.meta.json" \
  --eval "$out/eval_chain.json" --device "$dev" --slice "$stash/slice.json" \
  --out "$out/summary.json" | tee -a "$log"
ls -la "$out" | tee -a "$log"
