#!/usr/bin/env bash
# Packs what a lent GPU machine (the workplace's `device` tool) needs and cannot download: the
# embedded target's GGUF (98 MB, over the 64 MiB one call may carry with the 23 MB working tree)
# in three parts, one per call, and the wheels its image lacks (hydra-core, omegaconf, gguf...).
#   bash scripts/gpu_pack.sh          # here, once: writes .gpu/p1 .gpu/p2 .gpu/p3 (git-ignored)
# Then, on the device, three calls in a row (each within the 30 s a machine stays warm):
#   run "SKIP='shaped shaped_fused' bash scripts/gpu_check.sh exact \$OUT"  carry [".gpu/p1"]  timeout_s 270
#   run "bash scripts/gpu_check.sh stash"            carry [".gpu/p2"]
#   run "bash scripts/gpu_check.sh run \$OUT"        carry [".gpu/p3"]   timeout_s: what is left less 35
# (the ninth 2026-11-27 session: the machine's start and transfers took ~40 s, call 1 253 s,
# call 2 under 10 s, leaving call 3 555 s of the 900)
# (scripts/gpu_check.sh says what the last one runs.)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
gguf=$(python3 -c "from models.target import SMOLLM2_GGUF, smollm2_package_dir; print(smollm2_package_dir() / SMOLLM2_GGUF)")
rm -rf .gpu/p1 .gpu/p2 .gpu/p3
mkdir -p .gpu/p1/whl .gpu/p2 .gpu/p3
size=$(stat -c %s "$gguf")
part=$(((size + 2) / 3))
split -b "$part" -d -a 2 "$gguf" .gpu/part_
mv .gpu/part_00 .gpu/p1/
mv .gpu/part_01 .gpu/p2/
mv .gpu/part_02 .gpu/p3/
sha256sum "$gguf" | cut -d' ' -f1 >.gpu/p3/gguf.sha256
# the device's python is 3.12 with torch, transformers, accelerate, datasets...; these it lacks
# (the versions installed here, all pure Python: a wheel built here installs there)
pins=$(python3 -m pip list --format=freeze 2>/dev/null |
  grep -iE '^(hydra-core|omegaconf|antlr4-python3-runtime|gguf|dill)==' | tr '\n' ' ')
# shellcheck disable=SC2086
python3 -m pip wheel -q --no-deps -w .gpu/p1/whl $pins  # antlr4 4.9.3 is an sdist: built here
du -sh .gpu/p1 .gpu/p2 .gpu/p3
