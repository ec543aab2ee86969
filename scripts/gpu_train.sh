#!/usr/bin/env bash
# Train an EAGLE-3 head on a CUDA machine, in one command: the target answers a slice of the
# training prompts on the GPU, a head continues training on those answers (from the shipped
# head, or from an earlier run's weights), and the new head is measured on MT-bench with the
# compiled decoder.
#
#   bash scripts/gpu_train.sh [OUT]      # OUT: default runs/gpu/<UTC stamp>
#
# Installs specdraft first where it is not importable (bash scripts/install.sh: the package
# index must be reachable; on a machine without network, unpack an offline bundle first and set
# SITE, see scripts/offline_bundle.py --help). Writes into OUT:
#   regen.jsonl (+ .meta.json)  the target's answers to the slice (specdraft-prepare)
#   run/                        the training run: run/final is the new draft (draft=OUT/run/final)
#   eval_chain.json             the new head on MT-bench's first turns, chain of 3, T = 0
#   summary.json                the slice, training tokens/s and model FLOP utilisation,
#                               validation acceptance, the MT-bench figures
#   run/lineage.json            the learning curves behind the head (the shipped head's phases,
#                               earlier runs), for scripts/plot_curves.py --lineage
#   train.log, progress.err     every step's command, exit code and output
# and prints the command that continues from these weights: on the replies of this run and the
# rest of the slice where regeneration did not reach its end (REGEN_FROM), else on the next
# slice. Short runs add up; carry OUT/regen.jsonl and its .meta.json to the next machine.
#
# Steps (each capped at its program's own budget x 1.3 + a margin, times LIMIT_SCALE):
#   regen  (REGEN_MIN, 4 min) the target's replies of <= 256 tokens at REGEN_T (0: greedy) to
#          the first REGEN_TURNS (1) user turns of COUNT conversations after the first SKIP (DATA:
#          a file or folder; default the packaged ShareGPT; a later turn follows the target's own
#          earlier replies), prompt and reply <= 768 tokens, REGEN_BATCH (512) at a time on the
#          batched decoder (REGEN_COMPILE, auto; if that writes nothing, again with compile=false;
#          REGEN_ADMIT (1): free rows before waiting prompts join, prefilled together; its log
#          says where the loop's time went: forwards, prefills, the rest);
#          REGEN_ENGINE=vllm writes them with vLLM instead (bash scripts/install.sh vllm);
#          REGEN_FROM (an earlier run's OUT, or its regen.jsonl with the .meta.json beside it):
#          start from its replies and write only the conversations it did not reach
#   train  (TRAIN_MIN, 2 min) specdraft-train experiment=EXPERIMENT (eagle3_smollm2_gpu) on all
#          the replies, from INIT (default: the shipped smollm2-eagle3; null: from scratch), at
#          most EPOCHS (3) passes over them. Training reads replies ~9x faster than the target
#          writes them (an NVIDIA H200, 2026-12-04: ~75,000 against ~9,000 reply tokens/s), so
#          the budget goes mostly to regeneration, and a run that would pass over its replies
#          more often stops early instead (15 passes in 3 minutes overfit: docs/benchmarks.md)
#   eval   (110 s) MT-bench's first turns (PROMPTS 80 x TOKENS 128), chain of 3, T = 0
#
# Environment: DEVICE (cuda), SKIP (0), COUNT (20000), DATA, INIT, TARGET (the Hydra target
# group, default smollm2_135m; `hf` with TARGET_ARGS="target.path=<folder or hub id>"),
# TARGET_ARGS, EXPERIMENT, EXTRA_TRAIN (more training overrides), REGEN_MIN, TRAIN_MIN, EPOCHS,
# REGEN_FROM, REGEN_T, REGEN_TURNS, REGEN_BATCH, REGEN_ADMIT, REGEN_COMPILE, REGEN_ENGINE,
# PROMPTS, TOKENS, LIMIT_SCALE, SITE, NO_INSTALL=1. A CPU run of the whole recipe in a few minutes, on the tiny random target (as
# tests/test_gpu_recipe.py runs it; its greedy replies are only whitespace, so REGEN_T=1 samples
# them, and EAGLE-3 needs its 4-layer shape):
#   DEVICE=cpu TARGET=tiny_random TARGET_ARGS=target.tiny_layers=4 INIT=null COUNT=12 \
#     REGEN_MIN=0.1 REGEN_T=1 REGEN_BATCH=4 TRAIN_MIN=0.1 PROMPTS=2 TOKENS=8 \
#     EXTRA_TRAIN="data.batch_size=4 data.num_proc=1 data.max_length=128 \
#     method.draft_vocab_size=64 train.eval_every=0 train.log_every=1" \
#     bash scripts/gpu_train.sh /tmp/gpu-train
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu_common.sh
source scripts/gpu_common.sh
begin runs/gpu train.log "$0" "$@"
ensure_installed
log_machine

skip=${SKIP:-0}
count=${COUNT:-20000}
init=${INIT:-smollm2-eagle3}
# shellcheck disable=SC2206
tgt=("target=${TARGET:-smollm2_135m}" "target.device=$dev" ${TARGET_ARGS:-})
data=()
[ -n "${DATA:-}" ] && data=("data.path=$DATA")
regen_min=${REGEN_MIN:-4}
train_min=${TRAIN_MIN:-2}
secs() { python3 -c "import math; print(math.ceil(60 * $1 * 1.3 + ${2:-60}))"; }
python3 - "$out/slice.json" "$skip" "$count" "$init" "${DATA:-}" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "scripts")
from plot_curves import lineage
from models.base import resolve_draft_dir
from models.shipped import shipped_draft
path, skip, count, init, data = sys.argv[1:]
folder = None if init == "null" else shipped_draft(init) or resolve_draft_dir(Path(init))
if init != "null" and folder is None:
    sys.exit(f"INIT={init}: not a saved draft, run or checkpoint folder, nor a shipped draft's name")
curves = lineage(folder) if folder is not None else []
Path(path).write_text(json.dumps({"data": data or "packaged ShareGPT", "skip": int(skip),
    "count": int(count), "init": str(folder) if folder else None, "lineage": curves}, indent=1))
PY
[ $? -eq 0 ] || exit 2
echo "slice: conversations $skip..$((skip + count - 1)), init: $init" | tee -a "$log"
if [ -n "${REGEN_FROM:-}" ]; then
  from=$REGEN_FROM
  [ -d "$from" ] && from=$from/regen.jsonl
  if [ ! -s "$from" ] || [ ! -f "$from.meta.json" ]; then
    echo "REGEN_FROM=$REGEN_FROM: no regen.jsonl with its .meta.json beside it (an earlier" \
      "run's output folder, or its regen.jsonl)" >&2
    exit 2
  fi
  if [ ! -e "$out/regen.jsonl" ]; then
    cp "$from" "$out/regen.jsonl" && cp "$from.meta.json" "$out/regen.jsonl.meta.json" || exit 2
  fi
  echo "regeneration starts from the $(wc -l <"$from") conversations of $from" | tee -a "$log"
fi

regen() {
  local engine=()
  [ -n "${REGEN_ENGINE:-}" ] && engine=("engine=$REGEN_ENGINE")
  step "$1" "$(secs "$regen_min")" python3 -m flow.regenerate "${tgt[@]}" "${data[@]}" \
    "data.skip_records=$skip" "data.max_records=$count" "out=$out/regen.jsonl" "max_turns=${REGEN_TURNS:-1}" \
    max_new_tokens=256 data.max_length=768 "temperature=${REGEN_T:-0}" \
    "batch_size=${REGEN_BATCH:-512}" "batch_admit=${REGEN_ADMIT:-1}" \
    "max_minutes=$regen_min" progress=false "compile=$2" \
    "${engine[@]}"
}
regen regen "${REGEN_COMPILE:-auto}"
if [ ! -s "$out/regen.jsonl" ] && [ "${REGEN_COMPILE:-auto}" != false ] && [ -z "${REGEN_ENGINE:-}" ]; then
  echo "regeneration wrote nothing: again with compile=false" | tee -a "$log"
  regen regen_hf false
fi
if [ ! -s "$out/regen.jsonl" ]; then
  echo "no replies were regenerated: see $out/progress.err" | tee -a "$log" >&2
  exit 1
fi
# shellcheck disable=SC2086
step train "$(secs "$train_min" 120)" python3 -m flow "experiment=${EXPERIMENT:-eagle3_smollm2_gpu}" \
  "${tgt[@]}" "data.path=$out/regen.jsonl" "train.init_from=$init" \
  "train.max_minutes=$train_min" "train.epochs=${EPOCHS:-3}" train.progress=false \
  "output_dir=$out/run" ${EXTRA_TRAIN:-}
if [ ! -d "$out/run/final" ]; then
  echo "training left no final draft: see $out/progress.err" | tee -a "$log" >&2
  exit 1
fi
step eval 110 python3 -m decoding.eval "draft=$out/run/final" "${tgt[@]}" tree=chain gamma=3 \
  adaptive=false "num_prompts=${PROMPTS:-80}" "max_new_tokens=${TOKENS:-128}" temperature=0 \
  compile=auto "report=$out/eval_chain.json"
# the summary is written even where the measurement failed (its figures are then left out)
evalarg=()
[ -s "$out/eval_chain.json" ] && evalarg=(--eval "$out/eval_chain.json")
python3 scripts/gpu_train_summary.py --run "$out/run" --regen "$out/regen.jsonl.meta.json" \
  "${evalarg[@]}" --device "$dev" --slice "$out/slice.json" \
  --out "$out/summary.json" | tee -a "$log"
echo "draft: $out/run/final"
echo "  measure:  specdraft-eval draft=$out/run/final tree=chain gamma=3 adaptive=false"
# a curve where there is one: this run's validation, or the curves behind the weights it began from
curve=false
grep -q '"val/alpha_pos1"' "$out/run/metrics.jsonl" 2>/dev/null && curve=true
[ "$init" != null ] && curve=true
if $curve; then
  echo "  curve:    python scripts/plot_curves.py --lineage $out/run/lineage.json --metric alpha --out $out/curves.png"
fi
left=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1])).get('not_reached', 0))" \
  "$out/regen.jsonl.meta.json" 2>/dev/null || echo 0)
turns=${REGEN_TURNS:+REGEN_TURNS=$REGEN_TURNS }
if [ "${left:-0}" -gt 0 ]; then # the rest of this slice first, with the replies written so far
  echo "  continue: ${turns}SKIP=$skip COUNT=$count REGEN_FROM=$out INIT=$out/run/final bash scripts/gpu_train.sh" \
    "  ($left conversations of the slice not reached yet)"
else
  echo "  continue: ${turns}SKIP=$((skip + count)) COUNT=$count INIT=$out/run/final bash scripts/gpu_train.sh"
fi
