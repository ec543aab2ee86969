"""Every entry point answers ``--help``: each Python script in scripts/ and each console script
of the package prints its usage and exits 0, without running anything (``-h`` is the same
option in each; one flag keeps this file to one interpreter start per entry point)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import distribution
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))
CONSOLE = sorted(
    ep.name for ep in distribution("specdraft").entry_points if ep.group == "console_scripts"
)
ENTRIES = [f"scripts/{s}" for s in SCRIPTS] + CONSOLE


def command(entry: str) -> list[str]:
    """How a user runs ``entry``: a script with this interpreter, a console script as installed
    beside it."""
    if entry.startswith("scripts/"):
        return [sys.executable, str(ROOT / entry)]
    exe = Path(sys.executable).parent / entry
    if not exe.exists():
        pytest.fail(f"{entry}: not installed beside {sys.executable} (run `pip install -e .`)")
    return [str(exe)]


def run_help(entry: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*command(entry), "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def answers() -> dict[str, subprocess.CompletedProcess]:
    """Every entry point asked once, one per core at a time (most of each run is imports)."""
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return dict(zip(ENTRIES, pool.map(run_help, ENTRIES), strict=True))


def test_the_installed_console_scripts_are_pyproject_s():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(scripts) == CONSOLE, "[project.scripts] changed since `pip install -e .`"


@pytest.mark.parametrize("entry", ENTRIES)
def test_help_prints_usage_and_exits_0(answers, entry):
    r = answers[entry]
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{entry} --help: exit {r.returncode}\n{out[-2000:]}"
    assert "usage:" in out.lower(), f"{entry} --help: no usage line\n{out[-2000:]}"


SHELL = sorted(
    p.name
    for p in (ROOT / "scripts").glob("*.sh")
    if p.name != "gpu_common.sh"  # sourced
)


@pytest.mark.parametrize("script", SHELL)
def test_shell_scripts_print_their_header_and_run_nothing(script, tmp_path):
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / script), "--help"],
        cwd=tmp_path,  # nothing they could write lands in the repository
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, f"{script} --help: exit {r.returncode}\n{r.stderr[-2000:]}"
    lines = r.stdout.splitlines()
    assert len(lines) >= 2 and not lines[0].startswith(("#", "case", "set ")), r.stdout[:500]
    assert list(tmp_path.iterdir()) == [], "--help wrote files"


@pytest.mark.parametrize("args", [["vlm"], ["dev", "engine"], ["--dev"]])
def test_install_refuses_a_part_it_does_not_have_before_installing_anything(args, tmp_path):
    """``install.sh vlm`` (a typo) would otherwise install the toolkit and say nothing."""
    r = subprocess.run(
        [shutil.which("bash"), str(ROOT / "scripts" / "install.sh"), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": str(tmp_path)},  # nothing to run, were it to go on
    )
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: install.sh "), r.stderr
    assert "dev, engine, vllm" in r.stderr


def _gpu_check_steps() -> list[str]:
    """The steps scripts/gpu_check.sh's header lists, in its order."""
    header = (ROOT / "scripts" / "gpu_check.sh").read_text().split("\nset ", 1)[0]
    body = header.split("# Steps, in this order", 1)[1].split("# Environment:", 1)[0]
    return re.findall(r"^#   ([a-z_0-9]+) +\(\d+\)", body, flags=re.M)


def test_gpu_check_refuses_a_misspelled_step_before_it_writes_anything(tmp_path):
    """A misspelled ONLY would skip every step after the machine's start-up, on a GPU rented
    for minutes: the script names the step and the steps it has, and writes nothing."""
    steps = _gpu_check_steps()
    code = (ROOT / "scripts" / "gpu_check.sh").read_text()
    ran = re.findall(r"(?:^|\s)step ([a-z_0-9]+) \d+", code)
    assert ran == steps and len(steps) >= 10, (ran, steps)  # the header documents every step
    out = tmp_path / "out"
    for env in ({"ONLY": "regen_hots"}, {"SKIP": f"{steps[0]} hff"}):
        r = subprocess.run(
            ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "NO_INSTALL": "1", **env},
        )
        bad = env.get("ONLY", "hff")
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (r.returncode, r.stderr)
        assert f"no step named '{bad}'" in r.stderr and " ".join(steps) in r.stderr, r.stderr
        assert not out.exists()


@pytest.mark.parametrize(
    "entry,groups",
    [
        ("specdraft-train", ["target", "data", "optim", "method", "logger", "experiment", "debug"]),
        ("specdraft-eval", ["target"]),
        ("specdraft-prepare", ["target", "data"]),
    ],
)
def test_hydra_help_lists_the_commands_own_groups_and_their_options(answers, entry, groups):
    """A Hydra command's ``--help`` lists the groups it composes, each with the options a user
    can pick (the YAML files of conf/<group>/), and neither another command's groups nor the
    typed schemas (``target_schema``, ``schema/method``...) Hydra's own list would show."""
    out = answers[entry].stdout
    listed = out.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    lines = [x for x in listed.splitlines() if ": " in x and not x.startswith("Compose")]
    assert [x.split(":", 1)[0] for x in lines] == groups, listed
    for line in lines:
        group, options = line.split(": ", 1)
        want = sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
        assert options.split(", ") == want, line
    assert "schema" not in listed
