#!/usr/bin/env bash
# Drafters side by side at an equal training budget on one data file (best: the target's own
# answers, `specdraft-prepare`), every step run alone on the machine: train each for MINUTES
# of wall clock (validation excluded) or EPOCHS passes over the data, whichever ends first
# (EPOCHS=1: the faster drafters see the same tokens as each other, the slower ones fewer in
# the same minutes; a large EPOCHS makes the minutes alone the budget), plot their validation agreement against training
# tokens, decode MT-bench with each at a fixed chain length in the built-in decoder, and
# measure inside vLLM the ones vLLM serves (its acceptance per position beside ours).
#
#   DATA=regen.jsonl MINUTES=9 bash scripts/compare_drafters.sh [OUT] [ENTRY ...]
#
# OUT: default runs/compare/<UTC stamp>. ENTRY: LABEL=EXPERIMENT[,OVERRIDE...], e.g.
#   dpace=dflash_smollm2_20min,method.loss=dpace   eagle3_1=eagle3_smollm2_20min,method=eagle3_1
# Default entries: DSpark, Domino, DFlash, P-EAGLE, EAGLE-3 and HASS with the
# <method>_smollm2_20min recipes (batch 4 x <= 512 tokens, lr 3e-4, warm-up 20, cosine decay
# over the budget). Environment: MINUTES (9), EPOCHS (1), PROMPTS (6), TOKENS (64), GAMMA (4: drafted
# tokens an iteration, adaptive off, so every drafter drafts the same), VLLM (1: measure in vLLM
# where it serves the draft and is installed; 0: skip), SKIP_TRAIN=1 (reuse OUT/runs).
# Writes OUT/runs/<label>/, OUT/curves.png, OUT/decode/ (bench_decode's table and reports),
# OUT/vllm-<label>.json and OUT/compare.log (every command and its output).
case "${1:-}" in -h | --help)
  sed -n '2,/^[^#]/{/^[^#]/d;s/^# \{0,1\}//;p}' "$0"
  exit 0
  ;;
esac
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:?set DATA to a conversations file (best: the answers of the target itself, specdraft-prepare)}"
[ -f "$DATA" ] || { echo "DATA=$DATA: no such file" >&2; exit 2; }
OUT=${1:-runs/compare/$(date -u +%Y%m%d-%H%M%S)}
shift || true
MINUTES=${MINUTES:-9} PROMPTS=${PROMPTS:-6} TOKENS=${TOKENS:-64} GAMMA=${GAMMA:-4}
ENTRIES=("$@")
if [ ${#ENTRIES[@]} -eq 0 ]; then
  ENTRIES=(dspark=dspark_smollm2_20min domino=domino_smollm2_20min
    dflash=dflash_smollm2_20min peagle=peagle_smollm2_20min
    eagle3=eagle3_smollm2_20min hass=hass_smollm2_20min)
fi
mkdir -p "$OUT/runs"
LOG="$OUT/compare.log"
run() { echo "+ $*" | tee -a "$LOG"; "$@" 2>&1 | tee -a "$LOG"; }
{ date -u; python3 -c "from decoding.engines.base import cpu_name; print(cpu_name())"; } >>"$LOG"

labels=() runs=()
for e in "${ENTRIES[@]}"; do
  label=${e%%=*} spec=${e#*=}
  IFS=, read -r -a parts <<<"$spec"
  exp=${parts[0]} extra=("${parts[@]:1}")
  labels+=("$label") runs+=("$OUT/runs/$label")
  if [ "${SKIP_TRAIN:-0}" != 1 ]; then
    run specdraft-train "experiment=$exp" "data.path=$DATA" "train.max_minutes=$MINUTES" \
      "train.epochs=${EPOCHS:-1}" \
      train.eval_every=15 data.val_fraction=0.05 data.max_val_records=48 \
      "output_dir=$OUT/runs/$label" train.progress=false "${extra[@]}"
  fi
done
run python3 scripts/plot_curves.py "${runs[@]}" --labels "${labels[@]}" --metric top1 \
  --positions 2 --out "$OUT/curves.png"
run python3 scripts/bench_decode.py --drafts "${runs[@]}" --temperatures 0 \
  --num-prompts "$PROMPTS" --max-new-tokens "$TOKENS" --bench mt_bench --out "$OUT/decode" \
  adaptive=false "gamma=$GAMMA"
# whether vLLM serves a run's draft here (its export format, vLLM installed, not GPU-only)
VLLM_CHECK='
import sys
from pathlib import Path
from decoding.engines.vllm_eval import FORMAT_OF_METHOD, served_formats, vllm_python
from models.base import read_draft_config, resolve_draft_dir
m = read_draft_config(resolve_draft_dir(Path(sys.argv[1])))["specdraft"]["method"]
fmt = FORMAT_OF_METHOD.get(m)
ok = fmt in served_formats() and fmt != "dspark" and vllm_python(required=False) is not None
print(sys.argv[1] + ": " + m + (" -> vLLM " + str(fmt) if ok else ": not measured in vLLM here"))
sys.exit(0 if ok else 1)
'
if [ "${VLLM:-1}" = 1 ]; then
  for i in "${!runs[@]}"; do
    if python3 -c "$VLLM_CHECK" "${runs[$i]}" | tee -a "$LOG"; [ "${PIPESTATUS[0]}" = 0 ]; then
      run specdraft-eval engine=vllm "draft=${runs[$i]}" gamma=3 "num_prompts=$PROMPTS" \
        "max_new_tokens=$TOKENS" "report=$OUT/vllm-${labels[$i]}.json"
    fi
  done
fi
echo "done: $OUT"
