#!/usr/bin/env bash
# The compiled decoder on a CUDA machine: its exactness tests with real CUDA graphs, then its
# figures with the shipped EAGLE-3 head on the embedded target, in one command.
#
#   bash scripts/gpu_check.sh [OUT]      # OUT: default runs/gpu-check/<UTC stamp>
#
# Installs specdraft first where it is not importable (bash scripts/install.sh: the package
# index must be reachable; on a machine without network, unpack an offline bundle first and set
# SITE, see scripts/offline_bundle.py --help). Writes into OUT: check.log (every step's command,
# exit code and output), progress.err, and the JSON reports named below.
#
# Steps, in this order (seconds: each step's cap, times LIMIT_SCALE; LIMIT_SCALE=0 lifts them):
#   exact        (150) the decoder's exactness tests on CUDA (SPECDRAFT_TEST_DEVICE=cuda): the
#                lean forward and its static cache against transformers, the runner-parametrized
#                tests of tests/test_decoder.py with real graphs, the static EAGLE chain, the
#                batch's T > 0 acceptance on the device
#   batch_exact  (75)  the batched decoder on CUDA: every row its batch-1 greedy output on the
#                static batch cache's graphs, the batched chain and tree on fixed shapes
#   shaped       (110) a Llama-3.1-8B-shaped target with random weights (no download): forward
#                ms at 1 / 8 / 16 / 32 tokens against the memory-bandwidth limit, the one-token
#                forward in parts (each projection kind, attention, LM head: ms and fraction of
#                the copy bandwidth; the rest: norms, RoPE, cache writes, gaps), an EAGLE-3
#                draft step against a target step (shaped.json)
#   shaped_fused (100) the same forward with compile=fused's layers (shaped_fused.json)
#   family       (150) targets beyond the Llama family with random weights, each config in
#                FAMILY_CONFIGS (a Gemma-3 shape of 268M parameters, Qwen3-30B-A3B): forward
#                ms by width on transformers' path and on the static path's graphs
#                (family_<config>.json)
#   exact_fused  (120) the exactness tests of compile=fused
#   embedded     (40)  the lean forward on the embedded target against transformers'
#   draft        (80)  the shipped head's proposals in parts: chain of 3 and an EAGLE-2 tree,
#                eager / fixed shapes / graph replay / host part; a draft LM's chain of 3 (the
#                target's first 4 layers) on transformers' forward, the lean forward eager and
#                as one graph replay (costs.json)
#   accept       (40)  T = 1 acceptance for 1 and 16 rows, on the host against on the device
#   regen_host   (90)  the data generator's loop on the tiny target, nothing drafted, REGEN_ROWS
#                (512) rows with continuous batching on the static cache's graphs: tokens/s,
#                ms a step and the host's share (regen_host.json)
#   goodput      (150) MT-bench first turns, T = 0, B = 16, chain of <= 3, goodput policy
#                (goodput_b16.json)
#   tree         (140) the same at B = 1, EAGLE-2 tree (depth 5, top_k 8, 32 nodes) (tree_t0.json)
#   t1           (140) chain of 3, T = 1, B = 1 (chain_t1.json)
#   chain_fused  (170) chain of 3, T = 0, compile=fused (chain_fused.json)
#   chain        (140) chain of 3, T = 0, compile=true (chain_t0.json)
#   costs        (70)  the embedded target's forward by width on each path, plain tokens/s
#   fused        (120) compile=fused against compile=true
#   batch        (100) the batched decoder's runners and drafters, ragged against static graphs
#   hf           (200) transformers' generate with a static cache and torch.compile
#
# Environment: DEVICE (cuda), PROMPTS (80), TOKENS (128), REGEN_ROWS (512), LIMIT_SCALE (1),
# SKIP / ONLY (step names), SHAPED_CONFIG (an architecture config folder in place of
# Llama-3.1-8B's), FAMILY_CONFIGS (config folders for the family step), SITE, NO_INSTALL=1
# (never install). A CPU smoke run of the whole path:
#   DEVICE=cpu PROMPTS=2 TOKENS=8 REGEN_ROWS=32 LIMIT_SCALE=4 SKIP=hf \
#     SHAPED_CONFIG=<small config> FAMILY_CONFIGS=<small config> bash scripts/gpu_check.sh /tmp/check
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu_common.sh
source scripts/gpu_common.sh
case "${1:-}" in -h | --help) ;; *) check_step_names "$0" ;; esac
begin runs/gpu-check check.log "$0" "$@"
ensure_installed
log_machine

SPECDRAFT_TEST_DEVICE=$dev step exact 150 python3 -m pytest -q -o addopts="" \
  -p no:cacheprovider tests/test_compiled.py tests/test_decoder.py tests/test_verify.py \
  -k "(runner or static or graph or lean or compile or discipline or greedy_speculative or tree_verification or on_the_device) and not embedded_target and not fused and not sample_on_host"
SPECDRAFT_TEST_DEVICE=$dev step batch_exact 75 python3 -m pytest -q -o addopts="" \
  -p no:cacheprovider tests/test_batch.py -k "every_row_equals or static_batch or compacting or fixed_shapes"
step shaped 110 python3 scripts/bench_compiled.py --parts shaped --device "$dev" \
  --reps 10 --out "$out/shaped.json" ${SHAPED_CONFIG:+--config "$SHAPED_CONFIG"}
step shaped_fused 100 python3 scripts/bench_compiled.py --parts shaped_fused --device "$dev" \
  --reps 10 --out "$out/shaped_fused.json" ${SHAPED_CONFIG:+--config "$SHAPED_CONFIG"}
families=${FAMILY_CONFIGS:-scripts/model_configs/gemma3-small scripts/model_configs/qwen3-30b-a3b}
# shellcheck disable=SC2016  # expanded by the inner shell, from its arguments
step family 150 bash -c 'd=$1 o=$2; shift 2; for c in "$@"; do
  python3 scripts/bench_compiled.py --parts family --layers 0 --device "$d" --reps 10 \
    --config "$c" --out "$o/family_$(basename "$c").json" || exit; done' _ "$dev" "$out" $families
SPECDRAFT_TEST_DEVICE=$dev step exact_fused 120 python3 -m pytest -q -o addopts="" \
  -p no:cacheprovider tests/test_compiled.py tests/test_decoder.py -k "fused and not embedded_target"

n=${PROMPTS:-80}
tokens=${TOKENS:-128}
chain=(draft=smollm2-eagle3 "target.device=$dev" tree=chain gamma=3 adaptive=false
  "max_new_tokens=$tokens")
SPECDRAFT_TEST_DEVICE=$dev step embedded 40 python3 -m pytest -q -o addopts="" \
  -p no:cacheprovider tests/test_compiled.py -k embedded_target
step draft 80 python3 scripts/bench_compiled.py --parts draft,draft_lm --device "$dev" \
  --tokens "$tokens" --out "$out/costs.json"
step accept 40 python3 scripts/bench_host.py --parts accept --device "$dev" --runs 5
step regen_host 90 python3 scripts/bench_host.py --parts regen --device "$dev" --runs 3 \
  --rows "${REGEN_ROWS:-512}" --out "$out/regen_host.json"
step goodput 150 python3 -m decoding.eval draft=smollm2-eagle3 "target.device=$dev" tree=chain \
  gamma=3 num_prompts="$n" max_new_tokens="$tokens" temperature=0 compile=true \
  "batch_sizes=[16]" "batch_policies=[goodput]" report="$out/goodput_b16.json"
step tree 140 python3 -m decoding.eval draft=smollm2-eagle3 "target.device=$dev" tree=dynamic \
  depth=5 top_k=8 total_tokens=32 adaptive=false "max_new_tokens=$tokens" num_prompts="$n" \
  temperature=0 compile=true report="$out/tree_t0.json"
step t1 140 python3 -m decoding.eval "${chain[@]}" num_prompts="$n" temperature=1 compile=true \
  report="$out/chain_t1.json"
step chain_fused 170 python3 -m decoding.eval "${chain[@]}" num_prompts="$n" temperature=0 \
  compile=fused report="$out/chain_fused.json"
step chain 140 python3 -m decoding.eval "${chain[@]}" num_prompts="$n" temperature=0 compile=true \
  report="$out/chain_t0.json"
step costs 70 python3 scripts/bench_compiled.py --parts forward,plain --device "$dev" \
  --tokens "$tokens" --out "$out/costs.json" --merge
step fused 120 python3 scripts/bench_compiled.py --parts fused --device "$dev" \
  --tokens "$tokens" --out "$out/costs.json" --merge
step batch 100 python3 scripts/bench_compiled.py --parts batch --device "$dev" \
  --tokens 64 --reps 4 --out "$out/costs.json" --merge
step hf 200 python3 scripts/bench_compiled.py --parts hf_compile --device "$dev" \
  --tokens "$tokens" --out "$out/costs.json" --merge
grep -E '^(==|   rc|all |decoder:|predicted)|tok/s|passed|failed|ms \(median\)' "$log"
echo "results: $out"
