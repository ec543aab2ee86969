"""What the offline bundle, the learning-curve plot and the GPU training summary do with input
they cannot use: one line saying what is wrong (naming the file, field or value), nothing the
user wrote lost, no plot or summary made of nothing."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def _one_line(text: str) -> str:
    assert text.count("\n") == 1 and "Traceback" not in text, text
    return text


def _call(script: str, monkeypatch, *args: str) -> None:
    """``scripts/<script>.py``'s ``main()`` with ``args`` as its command line."""
    module = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *args])
    module.main()


def _outcome(script: str, monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Its exit status, standard output and standard error."""
    try:
        _call(script, monkeypatch, *args)
        rc = 0
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


# ------------------------------------------------------------------------------ offline bundle


def _git(repo: Path, *args: str) -> None:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*cmd, *args], cwd=repo, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    """A small checkout holding the bundle script: what it packs as the source is this."""
    r = tmp_path / "repo"
    (r / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "offline_bundle.py", r / "scripts")
    (r / "README").write_text("a checkout\n")
    (r / "pkg").mkdir()
    (r / "pkg" / "a.py").write_text("A = 1\n")
    (r / "pkg" / "old.py").write_text("OLD = 1\n")
    _git(r, "init", "-q")
    _git(r, "add", "-A")
    _git(r, "commit", "-qm", "one")
    return r


def _bundle(root: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(root / "scripts" / "offline_bundle.py"), *args]
    return subprocess.run(cmd, cwd=cwd or root, capture_output=True, text=True)


def _pack(root: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    return _bundle(root, "pack", "--out", str(out), "--wheels", "none", "--target", "none", *args)


def test_pack_force_replaces_an_earlier_bundle_and_nothing_else(repo, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's notes")
    r = _pack(repo, mine, "--force")
    assert r.returncode == 2
    assert str(mine) in _one_line(r.stderr) and "notes.txt" in r.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert (mine / "notes.txt").read_text() == "the user's notes"
    # an empty folder takes a bundle; an earlier bundle is replaced only with --force
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _pack(repo, empty).returncode == 0
    first = (empty / "bundle.json").read_text()
    r = _pack(repo, empty)
    assert r.returncode == 2 and "--force" in _one_line(r.stderr)
    (repo / "README").write_text("a change\n")
    _git(repo, "commit", "-qam", "two")
    assert _pack(repo, empty, "--force").returncode == 0
    assert (empty / "bundle.json").read_text() != first
    assert sorted(p.name for p in empty.iterdir()) == ["bundle.json", "part_00"]
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


@pytest.mark.parametrize(
    "out, extra, says",
    [
        ("file", [], "a file, not a folder"),
        (".", ["--force"], "the current folder"),
        ("b", ["--part-size", "inf"], "--part-size 'inf'"),
        ("b", ["--part-size", "1"], "would make"),
    ],
)
def test_pack_refuses_bad_arguments_in_one_line(repo, tmp_path, out, extra, says):
    (tmp_path / "file").write_text("not a folder")
    where = tmp_path / out if out != "." else Path(".")
    r = _bundle(repo, "pack", "--out", str(where), "--wheels", "none", "--target", "none", *extra)
    assert r.returncode == 2 and says in _one_line(r.stderr)
    assert (tmp_path / "file").read_text() == "not a folder"
    assert not (tmp_path / "b").exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]
    if says == "would make":  # how many parts, and a size that makes few enough
        size = r.stderr.split("use --part-size ")[1].split()[0]
        assert _pack(repo, tmp_path / "b", "--part-size", size).returncode == 0
        assert len(json.loads((tmp_path / "b" / "bundle.json").read_text())["parts"]) <= 1000


def test_a_part_size_beyond_the_bundle_makes_one_part(repo, tmp_path):
    r = _pack(repo, tmp_path / "b", "--part-size", "1e30T")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["bundle.json", "part_00"]


def test_pack_says_what_the_source_leaves_out_and_needs_a_checkout(repo, tmp_path):
    (repo / "pkg" / "a.py").write_text("A = 2  # not committed\n")
    r = _pack(repo, tmp_path / "b1")
    assert r.returncode == 0
    assert "uncommitted" in _one_line(r.stderr) and "pkg/a.py" in r.stderr
    shutil.rmtree(repo / ".git")  # as in an unpacked bundle's source
    r = _pack(repo, tmp_path / "b2")
    assert r.returncode == 2 and "not a git checkout" in _one_line(r.stderr)
    assert "--no-source" in r.stderr and not (tmp_path / "b2").exists()


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda m: m.pop("parts"), "'parts'"),
        (lambda m: m.update(parts="part_00"), "parts is 'part_00'"),
        (lambda m: m["parts"][0].update(bytes="12"), "parts[0].bytes"),
        (lambda m: m["parts"][0].pop("sha256"), "parts[0].sha256"),
        (lambda m: m["parts"][0].update(name="../../x"), "parts[0].name"),
        (lambda m: m.pop("sha256"), "'sha256'"),
        (lambda m: m.update(contents=[]), "contents"),
    ],
)
def test_a_damaged_manifest_is_named_in_one_line(repo, tmp_path, damage, says):
    assert _pack(repo, tmp_path / "b").returncode == 0
    m = json.loads((tmp_path / "b" / "bundle.json").read_text())
    damage(m)
    (tmp_path / "b" / "bundle.json").write_text(json.dumps(m))
    r = _bundle(repo, "unpack", str(tmp_path / "b"), "--into", str(tmp_path / "there"))
    assert r.returncode == 2 and says in _one_line(r.stderr)
    assert "bundle.json" in r.stderr


def test_a_bundles_data_slice_asks_what_its_source_asks(tmp_path):
    """It carried each conversation's first user turn alone: ``REGEN_TURNS`` had no later turn
    to answer on the machine without network, and replies written from the source could not
    continue there (what a conversation asks was not the same). Every turn now, a system turn,
    tool calls and tool results kept, the replies cut to stubs."""
    import gzip

    import offline_bundle

    from data.conversations import load_conversations
    from flow.regenerate import _input_digest

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    records = [
        {
            "id": "multi",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "First?"},
                {"role": "assistant", "content": "x" * 500, "reasoning_content": "hm " * 200},
                {"role": "user", "content": "Second?"},
                {"role": "assistant", "content": "Two."},
            ],
        },
        {
            "id": "tool",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "messages": [
                {"role": "user", "content": "Call f."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "{}"},
                {"role": "assistant", "content": "Done."},
            ],
        },
    ]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    carried = tmp_path / "prompts.jsonl"
    carried.write_bytes(gzip.decompress(offline_bundle._prompts("0:2", str(source))))
    theirs, _ = load_conversations(source)
    ours, report = load_conversations(carried)
    assert report.kept == 2
    assert [(c.id, _input_digest(c)) for c in ours] == [(c.id, _input_digest(c)) for c in theirs]
    multi = ours[0].messages
    assert [m["role"] for m in multi] == ["system", "user", "assistant", "user", "assistant"]
    assert multi[2] == {"role": "assistant", "content": "x" * 64}  # a stub, no trace
    assert ours[1].messages[1]["tool_calls"] == theirs[1].messages[1]["tool_calls"]


def test_a_second_bundle_replaces_the_first_only_with_force(repo, tmp_path):
    into = tmp_path / "there"
    data = tmp_path / "data"
    r = _bundle(
        ROOT,
        *("pack", "--out", str(data), "--wheels", "none", "--target", "none", "--no-source"),
        *("--data-slice", "0:2"),
    )
    assert r.returncode == 0, r.stderr
    r = _bundle(repo, "unpack", str(data), "--into", str(into))
    assert r.returncode == 0 and "export DATA=" in r.stdout
    # a source-only bundle: refused while the data bundle is unpacked there
    src = tmp_path / "src"
    assert _pack(repo, src).returncode == 0
    r = _bundle(repo, "unpack", str(src), "--into", str(into))
    assert r.returncode == 2 and "--force" in _one_line(r.stderr) and "--into" in r.stderr
    assert not (into / "specdraft").exists() and (into / "content" / "data").is_dir()
    r = _bundle(repo, "unpack", str(src), "--into", str(into), "--force")
    assert r.returncode == 0, r.stderr
    assert "export DATA=" not in r.stdout and not (into / "content" / "data").exists()
    assert (into / "specdraft" / "pkg" / "old.py").is_file()
    # the user edits the unpacked source; the next bundle drops a file and changes another
    (into / "specdraft" / "pkg" / "a.py").write_text("A = 'edited here'\n")
    _git(repo, "rm", "-q", "pkg/old.py")
    (repo / "pkg" / "a.py").write_text("A = 3\n" + "# padding\n" * 2000)
    _git(repo, "commit", "-qam", "two")
    src2 = tmp_path / "src2"
    assert _pack(repo, src2, "--part-size", "16K").returncode == 0
    parts = sorted(p.name for p in src2.glob("part_*"))
    assert len(parts) >= 2
    # its parts arrive over several calls, as before; once whole, it is refused
    r = _bundle(
        repo, "unpack", str(src2 / parts[0]), str(src2 / "bundle.json"), "--into", str(into)
    )
    assert r.returncode == 3 and f"missing: {parts[1]}" in r.stdout
    r = _bundle(repo, "unpack", *[str(src2 / p) for p in parts[1:]], "--into", str(into))
    assert r.returncode == 2 and str(into / "parts") in _one_line(r.stderr)
    assert (into / "specdraft" / "pkg" / "old.py").is_file()
    r = _bundle(repo, "unpack", str(into / "parts"), "--into", str(into), "--force")
    assert r.returncode == 0, r.stderr
    assert not (into / "specdraft" / "pkg" / "old.py").exists()
    assert (into / "specdraft" / "pkg" / "a.py").read_text().startswith("A = 3\n")
    kept = list(into.glob("specdraft.replaced-*"))
    assert len(kept) == 1 and f"kept {kept[0]}" in r.stdout
    assert (kept[0] / "pkg" / "a.py").read_text() == "A = 'edited here'\n"
    assert not (into / "parts").exists()
    # the same bundle again changes nothing
    (into / "specdraft" / "README").write_text("edited again\n")
    r = _bundle(repo, "unpack", str(src2), "--into", str(into))
    assert r.returncode == 0 and "already unpacked" in r.stdout and "cd " in r.stdout
    assert (into / "specdraft" / "README").read_text() == "edited again\n"


def test_unpack_does_not_write_over_a_folder_it_did_not_unpack(repo, tmp_path):
    into = tmp_path / "home"
    (into / "specdraft").mkdir(parents=True)
    (into / "specdraft" / "mine.py").write_text("mine\n")
    assert _pack(repo, tmp_path / "src").returncode == 0
    for force in ([], ["--force"]):
        r = _bundle(repo, "unpack", str(tmp_path / "src"), "--into", str(into), *force)
        assert r.returncode == 2 and "specdraft/" in _one_line(r.stderr)
    assert [p.name for p in (into / "specdraft").iterdir()] == ["mine.py"]


# ------------------------------------------------------------------------------ learning curves


def _rows(per_row) -> str:
    return "".join(
        json.dumps({"step": s, **per_row(s), "tokens": 1000 * s}) + "\n" for s in (2, 4, 6)
    )


MEDUSA = _rows(
    lambda s: {f"val/top{r}_head{k}": 0.1 * k + s / 100 for r in (1, 10) for k in (1, 2)}
)
MLP = _rows(
    lambda s: {
        f"val/{m}{k}": 0.1 * k + s / 100 for m in ("top1_stage", "alpha_pos") for k in (1, 2)
    }
)


@pytest.mark.parametrize("text", [MEDUSA, MLP], ids=["medusa", "mlp_speculator"])
def test_curves_of_medusa_heads_and_speculator_stages(tmp_path, text):
    from plot_curves import curves

    (tmp_path / "metrics.jsonl").write_text(text)
    got = curves(tmp_path, "top1", 5)
    assert [len(got[k]) for k in (1, 2, 3)] == [3, 3, 0]
    assert got[2][0] == (2000, pytest.approx(0.22))


def test_a_run_with_nothing_to_plot_is_an_error_not_an_empty_plot(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text(MEDUSA)
    png = tmp_path / "curves.png"
    with pytest.raises(SystemExit) as e:
        _call("plot_curves", monkeypatch, str(tmp_path), "--metric", "alpha", "--out", str(png))
    msg = str(e.value.code)
    assert "\n" not in msg and str(tmp_path / "metrics.jsonl") in msg
    assert "val/alpha_pos" in msg and "val/top1_head1..2" in msg
    assert not png.exists()
    _call("plot_curves", monkeypatch, str(tmp_path), "--out", str(png))
    assert png.stat().st_size > 10_000


def test_the_served_chain_is_one_curve_a_run(tmp_path, monkeypatch):
    """``--metric chain3``: what a chain of 3 accepts decoding the validation text, a figure a
    validation; a run that never logged it (Medusa) is named with what it holds."""
    from plot_curves import curves

    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "metrics.jsonl").write_text(
        _rows(lambda s: {"val/top1_pos1": 0.5, "val/chain3_alpha": 0.4 + s / 100})
    )
    got = curves(eagle, "chain3", 5)
    assert list(got) == [1] and got[1] == [(2000, 0.4 + 2 / 100), (4000, 0.44), (6000, 0.46)]
    png = tmp_path / "chain.png"
    _call("plot_curves", monkeypatch, str(eagle), "--metric", "chain3", "--out", str(png))
    assert png.stat().st_size > 10_000
    (tmp_path / "metrics.jsonl").write_text(MEDUSA)
    with pytest.raises(SystemExit) as e:
        _call("plot_curves", monkeypatch, str(tmp_path), "--metric", "chain3", "--out", str(png))
    assert "val/chain3_alpha" in str(e.value.code) and "val/top1_head1..2" in str(e.value.code)


def test_a_last_line_cut_short_is_left_out_one_in_the_middle_is_named(tmp_path, monkeypatch):
    run = tmp_path / "metrics.jsonl"
    run.write_text(MLP + MLP.splitlines()[0][:40])  # a run still writing
    png = tmp_path / "curves.png"
    _call("plot_curves", monkeypatch, str(run), "--out", str(png))
    assert png.is_file()
    lines = MLP.splitlines()
    run.write_text("\n".join([lines[0], lines[1][:40], lines[2]]) + "\n")
    with pytest.raises(SystemExit) as e:
        _call("plot_curves", monkeypatch, str(run), "--out", str(tmp_path / "other.png"))
    assert str(e.value.code).startswith(f"{run}:2: ") and "\n" not in str(e.value.code)


@pytest.mark.parametrize("script", ["plot_curves", "plot_lenience"])
def test_a_plot_never_writes_over_a_file_that_is_no_plot(tmp_path, monkeypatch, script):
    """--out naming data (or a folder, or a name no plot has) is one line and the file is
    left as it was; an earlier plot of the same name is replaced."""
    (tmp_path / "metrics.jsonl").write_text(MEDUSA)
    first = str(tmp_path) if script == "plot_curves" else str(tmp_path / "metrics.jsonl")
    data = tmp_path / "keep.png"
    data.write_text("not a plot")
    for out, why in (
        (data, "exists and is no PNG plot"),
        (tmp_path, "a folder; name a file in it"),
        (tmp_path / "curves.json", "a plot is written as .png, .pdf"),
        (data / "c.png", f"{data} is a file, not a folder"),
    ):
        with pytest.raises(SystemExit) as e:
            _call(script, monkeypatch, first, "--out", str(out))
        assert str(e.value.code).startswith(f"--out {out}: {why}"), e.value.code
    assert data.read_text() == "not a plot"
    if script == "plot_curves":
        png = tmp_path / "sub" / "curves.png"
        _call(script, monkeypatch, first, "--out", str(png))
        _call(script, monkeypatch, first, "--out", str(png))  # an earlier plot: replaced
        assert png.stat().st_size > 10_000


@pytest.mark.parametrize("text", [None, "", "{cut", '{"runs": []}', '{"curves": [["a.jsonl"]]}'])
def test_a_missing_or_malformed_lineage_is_one_line(tmp_path, monkeypatch, text):
    lin = tmp_path / "lineage.json"
    if text is not None:
        lin.write_text(text)
    with pytest.raises(SystemExit) as e:
        _call("plot_curves", monkeypatch, "--lineage", str(lin), "--out", str(tmp_path / "c.png"))
    assert str(e.value.code).startswith(f"{lin}: ") and "\n" not in str(e.value.code)


# ------------------------------------------------------------------------- GPU training summary


@pytest.fixture
def run(tmp_path):
    """A finished training run as gpu_train.sh leaves it, small."""
    import torch
    from safetensors.torch import save_file

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    save_file({"w": torch.zeros(4, 4)}, str(run / "final" / "model.safetensors"))
    cfg = {"specdraft": {"method": "eagle3"}, "method": {"ttt_steps": 2}, "target": "tiny"}
    (run / "final" / "config.json").write_text(json.dumps(cfg))
    (run / "summary.json").write_text(json.dumps({"target_params": 1000, "reason": "max_steps"}))
    rows = [{"step": s, "tokens_per_s": 100.0, "tokens": 64 * s} for s in (1, 2)]
    rows.append({"step": 2, "tokens": 128, "val/alpha_pos1": 0.5})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_the_summary_leaves_out_a_metrics_line_cut_short(run, tmp_path, monkeypatch, capsys):
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "tokens_per_s": 1')  # the run stopped while writing it
    rc, _, err = _outcome(
        "gpu_train_summary", monkeypatch, capsys, "--run", str(run), "--out", str(tmp_path / "s")
    )
    assert rc == 0, err
    s = json.loads((tmp_path / "s").read_text())
    assert s["train"]["steps"] == 2 and s["validation"] == [
        {"step": 2, "tokens": 128, "val/alpha_pos1": 0.5}
    ]
    assert (run / "lineage.json").is_file()


@pytest.mark.parametrize(
    "flag, make, says",
    [
        ("--run", None, "no such folder"),
        ("--eval", "", "empty"),
        ("--regen", "", "empty"),
        ("--eval", None, "no such file"),
        ("--slice", "[1, 2]", "not a JSON object"),
    ],
)
def test_the_summary_names_input_it_cannot_use(
    run, tmp_path, monkeypatch, capsys, flag, make, says
):
    given = tmp_path / "given"
    if make is not None:
        given.write_text(make)
    args = {"--run": str(run), "--out": str(tmp_path / "s"), flag: str(given)}
    rc, _, err = _outcome(
        "gpu_train_summary", monkeypatch, capsys, *[x for kv in args.items() for x in kv]
    )
    assert rc == 2 and f"{flag} {given}: {says}" in _one_line(err)
    assert not (tmp_path / "s").exists()


# ------------------------------------------------------------------------------ ship_draft


def test_ship_draft_checks_the_draft_before_it_writes(tmp_path):
    """Shipping replaced the shipped head's weights before it looked at what it was given:
    a model folder, an export or a draft for another target are refused first, in one line."""
    from ship_draft import checked_draft

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    serves = {"specdraft": {"method": "eagle3"}, "target": {"identity": "smol:aaa"}}
    (shipped / "config.json").write_text(json.dumps(serves))
    (shipped / "model.safetensors").write_bytes(b"shipped weights")

    def draft(where: Path, identity: str) -> Path:
        where.mkdir(parents=True)
        cfg = {"specdraft": {"method": "eagle3", "format_version": 1}, "method": {}}
        (where / "config.json").write_text(json.dumps({**cfg, "target": {"identity": identity}}))
        (where / "model.safetensors").write_bytes(b"w")
        return where

    def refused(src: Path, new_target: bool = False) -> str:
        with pytest.raises(SystemExit) as e:
            checked_draft(src, shipped, new_target)
        return str(e.value.code)

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "model.safetensors").write_bytes(b"m")
    assert "not a draft trained by specdraft" in refused(model)
    assert "no such folder" in refused(tmp_path / "nowhere")
    other = draft(tmp_path / "other" / "final", "tiny:bbb")
    assert "trained for target tiny:bbb, but shipped serves smol:aaa" in refused(other.parent)
    assert checked_draft(other.parent, shipped, True)[0] == other  # --new-target
    ours = draft(tmp_path / "run" / "final", "smol:aaa")
    assert checked_draft(tmp_path / "run", shipped, False)[0] == ours  # a run: its final/
    assert (shipped / "model.safetensors").read_bytes() == b"shipped weights"


# ------------------------------------------------------------------------------ family matrix

STAMP = {
    "date": "2026-01-02",
    "machine": "Zen 9, 2 cores",
    "command": "python scripts/family_matrix.py -k qwen3",
    "subset": True,
    "engines": {"vllm": True, "llama.cpp": True},
}
QWEN3 = [
    {"family": "qwen3", "method": "eagle3", "column": c, "value": "Y"}
    for c in ("trains", "exact", "exports", "trees")
]


def _matrix(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "scripts" / "family_matrix.py"), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_family_matrix_subset_runs_as_documented_and_leaves_the_page_alone(
    tmp_path, monkeypatch, capsys
):
    """`-k qwen3`, as the usage shows it, runs those tests only and writes its page beside the
    cells it recorded, not over docs/families.md."""
    import family_matrix

    page = tmp_path / "docs" / "families.md"
    page.parent.mkdir()
    page.write_text("# Model families\n\nthe whole matrix\n")
    given = []

    def run_tests(cells: Path, extra: list[str]) -> tuple[int, list[str]]:
        given.append(extra)
        with cells.open("a") as f:
            f.write("".join(json.dumps(c) + "\n" for c in QWEN3))
        return 0, []

    monkeypatch.setattr(family_matrix, "ROOT", tmp_path)
    monkeypatch.setattr(family_matrix, "run_tests", run_tests)
    monkeypatch.setattr(sys, "argv", ["family_matrix.py", "-k", "qwen3"])
    family_matrix.main()
    assert given == [["-k", "qwen3"]]
    assert page.read_text() == "# Model families\n\nthe whole matrix\n"
    out = Path(capsys.readouterr().out.split("wrote ")[1].split(" (")[0])
    text = out.read_text()
    assert "`python scripts/family_matrix.py -k qwen3`" in text and "| `qwen3` |" in text
    assert "no: " not in text and "not installed" not in text


@pytest.mark.parametrize("engines", [{"vllm": True, "llama.cpp": True}, {"vllm": False}])
def test_families_a_subset_did_not_run_are_not_shown_failing(engines):
    from family_matrix import render

    text = render(QWEN3, [], "2026-01-02", "Zen 9", "python scripts/family_matrix.py", engines)
    rows = {ln.split(" | ")[0]: ln for ln in text.splitlines() if ln.startswith("| `")}
    assert "no: " not in text
    assert ("not run (vLLM not installed)" in rows["| `qwen3`"]) == (engines["vllm"] is False)
    assert text.count("not installed") == (1 if engines["vllm"] is False else 0)
    assert "Run for 1 of" in text
    # a test that ran and failed before recording anything still says so
    failed = ["FAILED tests/test_families.py::test_each_method_trains[qwen2-hass] - boom"]
    text = render(QWEN3, failed, "2026-01-02", "Zen 9", "python scripts/family_matrix.py")
    assert text.count("no: trains, exact, exports") == 1


def test_rendered_cells_keep_the_date_and_machine_of_their_recording(tmp_path):
    import os

    cells = _jsonl(tmp_path / "c.jsonl", [{"run": STAMP}, *QWEN3, {"failed": ["FAILED x"]}])
    r = _matrix("--cells", str(cells), "--out", str(tmp_path / "p.md"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "p.md").read_text()
    assert "Measured 2026-01-02 on Zen 9, 2 cores: `python scripts/family_matrix.py -k qwen3`" in (
        text
    )
    assert "- `FAILED x`" in text
    # cells recorded by the tests alone: the date they were written, no machine made up
    bare = _jsonl(tmp_path / "bare.jsonl", QWEN3)
    os.utime(bare, (1767312000, 1767312000))  # 2026-01-02 (UTC)
    r = _matrix("--cells", str(bare), "--out", str(tmp_path / "p.md"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "p.md").read_text()
    assert "Measured 2026-01-0" in text and "a machine the cells do not name" in text
    # a subset's cells are written beside them by default
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare.jsonl", "c.jsonl", "p.md"]
    r = _matrix("--cells", str(cells), cwd=tmp_path)
    assert r.returncode == 0 and (tmp_path / "c.md").read_text().startswith("# Model families\n")


def test_the_family_matrix_replaces_only_its_own_pages(tmp_path):
    cells = _jsonl(tmp_path / "c.jsonl", [{"run": STAMP}, *QWEN3])
    mine = tmp_path / "mine.md"
    mine.write_text("# My notes\n")
    r = _matrix("--cells", str(cells), "--out", str(mine), cwd=tmp_path)
    assert r.returncode == 1 and "--force" in _one_line(r.stderr) and str(mine) in r.stderr
    assert mine.read_text() == "# My notes\n"
    assert (
        _matrix("--cells", str(cells), "--out", str(mine), "--force", cwd=tmp_path).returncode == 0
    )
    assert mine.read_text().startswith("# Model families\n")
    # its own page: replaced without asking
    mine.write_text("# Model families\n\nan earlier page\n")
    assert _matrix("--cells", str(cells), "--out", str(mine), cwd=tmp_path).returncode == 0
    assert "an earlier page" not in mine.read_text()


@pytest.mark.parametrize(
    "cells, out, says",
    [
        (None, "p.md", "c.jsonl: no such file"),
        ("{cut\n", "p.md", "c.jsonl:1: not a JSON line"),
        ('{"family": "qwen3"}\n', "p.md", "c.jsonl:1: not a cell"),
        ("", "nowhere/p.md", "no such folder"),
    ],
)
def test_family_matrix_input_it_cannot_use_is_one_line(tmp_path, cells, out, says):
    if cells is not None:
        (tmp_path / "c.jsonl").write_text(cells)
    r = _matrix("--cells", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / out), cwd=tmp_path)
    assert r.returncode == 1 and says in _one_line(r.stderr)
    assert not (tmp_path / "p.md").exists()


def test_a_family_matrix_subset_checks_its_out_before_running_tests(tmp_path):
    r = _matrix("-k", "qwen3", "--out", str(tmp_path / "nowhere" / "p.md"), cwd=tmp_path)
    assert r.returncode == 1 and "--out" in _one_line(r.stderr) and "no such folder" in r.stderr


# ------------------------------------------------------------------------------ engine agreement


def _engine_report(engine: str = "llama.cpp") -> dict:
    target = {"name": "tiny_random", "tiny_layers": 4, "device": "cpu", "dtype": "float32"}
    settings = {"engine": engine, "target": target, "draft": "ngram", "bench": "mt_bench"}
    settings |= {"num_prompts": 1, "n_max": 3, "max_new_tokens": 8}
    settings["target_identity"] = "tiny_random(seed=0, layers=4)"
    timings = {"draft_n": 4, "draft_n_accepted": 2}
    return {"settings": settings, "outputs": [{"turns": [{"engine_timings": timings}]}]}


def test_engine_agreement_loads_the_target_its_report_names(tmp_path, monkeypatch, capsys):
    import models.target

    loaded = []

    def load_target(cfg):
        loaded.append(cfg)
        return real(cfg)

    real = models.target.load_target
    monkeypatch.setattr(models.target, "load_target", load_target)
    report = tmp_path / "r.json"
    report.write_text(json.dumps(_engine_report()))
    rc, out, err = _outcome("engine_agreement", monkeypatch, capsys, str(report), "--num", "1")
    assert rc == 0, err
    assert [(c.name, c.tiny_layers) for c in loaded] == [("tiny_random", 4)]
    got = json.loads(out)
    assert got["target"] == "tiny_random(seed=0, layers=4)" and got["chain"] == 3
    assert got["engine_same_prompts"]["drafted"] == 4


@pytest.mark.parametrize(
    "text, says",
    [
        (None, "no such file"),
        ("{cut", "not a specdraft-eval report"),
        ("[1, 2]", "not a specdraft-eval report"),
        (json.dumps(_engine_report("torch")), "engine=torch, not of engine=llama.cpp"),
    ],
)
def test_engine_agreement_refuses_what_is_not_a_llama_cpp_report(
    tmp_path, monkeypatch, capsys, text, says
):
    report = tmp_path / "r.json"
    if text is not None:
        report.write_text(text)
    rc, out, err = _outcome("engine_agreement", monkeypatch, capsys, str(report))
    assert str(rc).startswith(f"{report}: ") and says in str(rc) and "\n" not in str(rc)
    assert out == ""


# ------------------------------------------------------------------------------ results plots


def test_results_plots_need_a_folder_not_a_file(tmp_path, monkeypatch):
    afile = tmp_path / "a.png"
    afile.write_text("not a folder")
    with pytest.raises(SystemExit) as e:
        _call("plot_results", monkeypatch, "--out", str(afile))
    assert "a file, not a folder" in str(e.value.code) and "\n" not in str(e.value.code)
    assert afile.read_text() == "not a folder"


def test_results_plots_replace_earlier_plots_but_not_other_files(tmp_path, monkeypatch):
    figs = tmp_path / "figs"
    figs.mkdir()
    (figs / "results_methods.png").write_text("the user's notes")
    with pytest.raises(SystemExit) as e:
        _call("plot_results", monkeypatch, "--out", str(figs))
    msg = str(e.value.code)
    assert "results_methods.png" in msg and "--force" in msg and "\n" not in msg
    assert sorted(p.name for p in figs.iterdir()) == ["results_methods.png"]
    assert (figs / "results_methods.png").read_text() == "the user's notes"
    _call("plot_results", monkeypatch, "--out", str(figs), "--force")
    assert (figs / "results_methods.png").read_bytes().startswith(b"\x89PNG")
    # its own earlier plots are replaced without asking
    (figs / "results_speedup.png").write_bytes(b"\x89PNG\r\n\x1a\n an earlier plot")
    _call("plot_results", monkeypatch, "--out", str(figs))
    assert (figs / "results_speedup.png").stat().st_size > 1000


def test_bench_decode_names_each_entrys_report_apart():
    """Two drafts whose folders end alike (``a/final``, ``b/final``) wrote one report, the
    first lost; the same draft twice gets its own file too."""
    from bench_decode import report_name

    taken: set[str] = set()
    names = [report_name(d, "", 0.0, taken) for d in ("a/final", "b/final", "b/final", "ngram")]
    assert names == ["final-T0", "b-final-T0", "b-final-T0~2", "ngram-T0"]
    assert report_name("truncate:4", "dynamic", 1.0, set()) == "truncate4-dynamic-T1"
    # a tag holding a path (disco=/x/y/disco) stays one file name, not folders under --out
    name = report_name("smollm2-eagle3", "chain-disco-6-/x/y/disco", 0.0, set())
    assert name == "smollm2-eagle3-chain-disco-6-_x_y_disco-T0" and "/" not in name


def test_the_decode_scripts_use_the_target_a_draft_was_made_for(tmp_path, monkeypatch, capsys):
    """tree_sizes.py and bench_decode.py decoded every draft against the embedded target: a
    head trained for another failed with a traceback. They take the draft's own target, as
    specdraft-eval does (an export's too), and a draft that cannot load is one line."""
    import torch

    from models.eagle import Eagle3Config, Eagle3Head
    from models.export import export
    from models.target import TargetConfig, load_target

    t4 = load_target(TargetConfig(name="tiny_random", tiny_layers=4, dtype="float32"))
    head = Eagle3Head(t4, Eagle3Config(fuse_layers=[1, 2, 3], draft_vocab_size=64)).eval()
    with torch.no_grad():  # a chosen draft vocabulary (an export refuses an unchosen one)
        head.d2t.copy_(torch.arange(64) * 2)
        head.t2d.zero_()
        head.t2d[torch.arange(64) * 3] = True
    export(head, "vllm", tmp_path / "v", log=lambda *_: None)
    rc, out, err = _outcome(
        "tree_sizes", monkeypatch, capsys, "--draft", str(tmp_path / "v"), "--bench",
        "mt_bench", "--num-prompts", "1", "--max-new-tokens", "8", "--depth", "2",
        "--top-k", "2", "--reps", "1", "--draft-weights", "full",
    )  # fmt: skip
    assert rc == 0 and "target: tiny_random" in err, err[-2000:]
    rc, out, err = _outcome(
        "bench_decode", monkeypatch, capsys, "--drafts", str(tmp_path / "v"), "--temperatures",
        "0", "--num-prompts", "1", "--max-new-tokens", "8", "--out", str(tmp_path / "b"),
    )  # fmt: skip
    assert rc == 0 and "target: tiny_random" in out, err[-2000:]
    assert (tmp_path / "b" / f"{str(tmp_path / 'v').strip('/').split('/')[-1]}-T0.json").is_file()
    rc, out, err = _outcome(
        "bench_decode", monkeypatch, capsys, "--drafts", str(tmp_path / "nope"), "--temperatures",
        "0", "--out", str(tmp_path / "b2"),
    )  # fmt: skip
    assert rc != 0


# ------------------------------------------------------------------------------- vLLM releases


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        ([], None, "name the vLLM releases to check"),
        (["0.x"], None, "release '0.x': not a vLLM release number"),
        (["--here"], None, "--here: SPECDRAFT_VLLM_PYTHON is unset"),
        (["--here", "0.32.0"], "/usr/bin/python3", "give no releases"),
        (["0.32.0", "--out", "nowhere/p.md"], None, "no such folder"),
        (["0.32.0", "--out", "mine.md"], None, "is not a page this script wrote"),
    ],
)
def test_vllm_versions_input_it_cannot_use_is_one_line(tmp_path, args, env, says):
    """Refused before anything is installed or run, and a page of the user's is left as it was."""
    (tmp_path / "mine.md").write_text("my notes\n")
    environ = {k: v for k, v in os.environ.items() if k != "SPECDRAFT_VLLM_PYTHON"}
    if env:
        environ["SPECDRAFT_VLLM_PYTHON"] = env
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "vllm_versions.py"), *args],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and says in _one_line(r.stderr), r.stderr
    assert (tmp_path / "mine.md").read_text() == "my notes\n"
    assert not (tmp_path / "nowhere").exists()


def test_vllm_versions_table_names_each_failure_and_each_release_not_installed(tmp_path):
    """A pytest JUnit report read into the row of its release: counts, and each failing test
    with its last line; a release that did not install is a row saying why."""
    vv = importlib.import_module("vllm_versions")
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_vllm" name="test_a[x]"/>'
        '<testcase classname="tests.test_families" name="test_b[gpt_oss]">'
        '<failure message="EngineError: vLLM: RuntimeError: expected scalar type | BFloat16">'
        "trace</failure></testcase>"
        '<testcase classname="tests.test_vllm" name="test_c"><skipped message="no"/></testcase>'
        '<testcase classname="" name="tests.test_speculators"><skipped message="x"/></testcase>'
        "</testsuite></testsuites>"
    )
    row = {"release": "0.29.0", **vv.read_junit(xml)}
    assert (row["passed"], row["failed"], row["skipped"]) == (1, 1, 1)
    gone = {"release": "0.26.0", "error": "not installed: torch==2.11.0+cpu is not on PyPI"}
    run = {"date": "2026-12-05", "machine": "a CPU, 2 cores", "command": "python x.py"}
    page = vv.render([row, gone], run)
    assert page.startswith(vv.HEADER + "\n") and "a CPU, 2 cores" in page
    lines = page.splitlines()
    assert "| 0.29.0 | 1 | 1 | 1 | `test_families::test_b[gpt_oss]`: EngineError" in page
    assert "scalar type / BFloat16" in page  # a | in a message does not split the table's cells
    assert lines[-1] == "| 0.26.0 | - | - | - | not installed: torch==2.11.0+cpu is not on PyPI |"


def test_vllm_only_selects_the_tests_that_serve_in_vllm():
    """``pytest --vllm-only`` (what scripts/vllm_versions.py runs against each release) keeps
    exactly the tests that need vLLM: each export format's serving test and the family
    matrix's vLLM column among them, nothing that runs without vLLM."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--vllm-only",
            "--collect-only",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
        ],  # fmt: skip
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    ids = [ln for ln in r.stdout.splitlines() if "::" in ln]
    assert r.returncode == 0 and ids, r.stdout[-2000:] + r.stderr[-2000:]
    assert any(
        "test_vllm_serves_the_export_and_accepts_what_we_do[dflash-dflash]" in i for i in ids
    )
    assert any("for_each_family_it_supports[qwen3]" in i for i in ids)
    assert not any("expand_repair" in i or "test_steps_from_positions" in i for i in ids)
    assert len(ids) < 100
