"""The package a user installs without ``-e`` (``pip install .``, a wheel, ``pip install
git+...``) holds all of specdraft: every module, config, prompt file and the shipped head.

The rest of the suite runs the editable install, which reads the source tree and so cannot see
a file the build leaves out (a method's folder missing from a hand-kept package list made
``import models`` fail in every installed copy). Here the wheel is built from the tracked files
alone, as a fresh clone would, and run from outside the repository."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the top-level packages (pyproject.toml's [tool.setuptools.packages.find])
PACKAGES = ("conf", "data", "decoding", "flow", "models", "trainer")


def source_files() -> list[str]:
    """The repository's files as a clone has them (tracked, or new and not ignored), relative."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: which files a clone holds is not known")
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """specdraft's wheel, built from a copy of the clone's files with the build backend pip
    uses (no network: setuptools as installed)."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed beside this interpreter: no wheel to build")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for f in source_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation"]
        + ["-q", "-w", str(tmp / "dist")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    (whl,) = (tmp / "dist").glob("specdraft-*.whl")
    return whl


@pytest.fixture(scope="module")
def unpacked(wheel) -> Path:
    site = wheel.parent.parent / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site


def test_the_wheel_holds_every_file_of_the_packages(wheel):
    with zipfile.ZipFile(wheel) as z:
        inside = set(z.namelist())
    wanted = [f for f in source_files() if f.split("/")[0] in PACKAGES]
    assert len(wanted) > 100, "the repository's package files were not found"
    missing = sorted(f for f in wanted if f not in inside)
    assert not missing, f"{len(missing)} files of the packages are not in the wheel: {missing[:20]}"
    stray = sorted(n for n in inside if n.split("/")[0] in ("tests", "scripts", "docs"))
    assert not stray, f"the wheel carries files that are not the package's: {stray[:10]}"


def installed_python(site: Path, code: str, *args: str, timeout: int = 300):
    """``code`` run by this interpreter with the unpacked wheel first on its path, from a folder
    outside the repository (nothing of the source tree on the path)."""
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=site.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


IMPORT_ALL = """
import importlib, pkgutil, sys
from pathlib import Path
site = Path(sys.argv[1]).resolve()
n = 0
for top in sys.argv[2:]:
    pkg = importlib.import_module(top)
    assert Path(pkg.__file__).resolve().is_relative_to(site), f"{top} came from {pkg.__file__}"
    for m in pkgutil.walk_packages(pkg.__path__, top + "."):
        if not m.name.endswith(".__main__"):  # ``python -m`` runs the program
            importlib.import_module(m.name)
        n += 1
print("imported", n)
"""


def test_every_module_imports_from_the_installed_copy(unpacked):
    r = installed_python(unpacked, IMPORT_ALL, str(unpacked), *PACKAGES)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) > 50, r.stdout


TRAIN_CONFIG = """
import sys
from flow.app import main
sys.argv = ["specdraft-train", "--cfg", "job", "experiment=quickstart"]
main()
"""


def test_the_installed_copy_composes_its_configs_and_finds_its_files(unpacked):
    r = installed_python(unpacked, TRAIN_CONFIG)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "method" in r.stdout and "eagle3" in r.stdout, r.stdout[-2000:]
    r = installed_python(
        unpacked,
        "from models.shipped import HERE; from decoding.bench import SPEC_BENCH; "
        "import sys; site = sys.argv[1]; "
        "assert str(HERE).startswith(site), HERE; assert str(SPEC_BENCH).startswith(site); "
        "assert (HERE / 'smollm2-eagle3' / 'model.safetensors').is_file(); "
        "assert SPEC_BENCH.is_file(); print('ok')",
        str(unpacked.resolve()),
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
