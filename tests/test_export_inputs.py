"""What specdraft-export and scripts/ship_draft.py do with input they cannot use as given: paths
with ``~``, damaged or foreign draft configs, shipped drafts, folders holding more than an
earlier export, a replacement that fails half-way. One line naming the file, field or value;
nothing the user wrote lost."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import every_third_eagle3, script_outcome, tiny_target_gguf

from flow.export import main
from models.export import ExportError, detect_format, export
from models.target import TargetConfig, load_target

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.fixture(scope="module")
def target():
    """A 4-layer tiny random target (EAGLE-3 fuses three distinct layers of it), rebuilt from
    its identity by a saved draft's config."""
    return load_target(TargetConfig(name="tiny_random", tiny_layers=4, dtype="float32"))


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory) -> Path:
    """A saved EAGLE-3 draft folder (what a run's final/ holds)."""
    where = tmp_path_factory.mktemp("saved") / "final"
    eagle3(target).save_draft(where)
    return where


def refused(capsys, *argv: str) -> str:
    """specdraft-export's one error line for ``argv`` (exit status 2)."""
    with pytest.raises(SystemExit) as e:
        main([*argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def quiet(*_):
    pass


# ------------------------------------------------------------------------------ specdraft-export


def eagle3(target):
    """The exports' EAGLE-3 head (every third token drafted), its weights as initialised."""
    return every_third_eagle3(target, noise=0.0)


def test_tilde_in_the_draft_and_out_is_the_home_folder(saved, tmp_path, monkeypatch, capsys):
    """``--out=~/x`` reaches the command as typed (no shell expands it there): it is the home
    folder's, never a folder named ``~`` in the working directory; so is a draft given so."""
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    shutil.copytree(saved, home / "runs" / "e3" / "final")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    main(["~/runs/e3", "--format", "vllm", "--dtype", "float32", "--out=~/exports/e3"])
    assert detect_format(home / "exports" / "e3") == "vllm"
    assert not (work / "~").exists()
    assert "serve it in vLLM" in capsys.readouterr().out


def test_the_target_gguf_is_named_by_its_absolute_path(
    saved, target, tmp_path, monkeypatch, capsys
):
    """``--target-gguf t.gguf``: the export's config.json and README named the file as typed,
    relative to wherever the export was made; they name it absolutely (``~`` expanded too)."""
    tiny_target_gguf(tmp_path / "t.gguf", target)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "g"
    main(
        [
            str(saved),
            "--format",
            "gguf",
            "--dtype",
            "float32",
            "--target-gguf",
            "t.gguf",
            "--out",
            str(out),
        ]
    )
    assert json.loads((out / "config.json").read_text())["target_gguf"] == str(tmp_path / "t.gguf")
    assert f"llama.cpp target: `{tmp_path / 't.gguf'}`" in (out / "README.md").read_text()
    assert "warning" not in capsys.readouterr().err


def test_a_damaged_draft_config_is_named_not_passed_over(saved, tmp_path, capsys):
    """A run whose final/config.json is damaged was reported as holding no saved draft at all."""
    run = tmp_path / "run"
    shutil.copytree(saved, run / "final")
    f = run / "final" / "config.json"
    f.write_text(f.read_text()[:80])
    err = refused(capsys, str(run), "--format", "vllm")
    assert f"{f}: not valid JSON" in err


@pytest.mark.parametrize(
    "edit,says",
    [
        (lambda c: c.pop("target"), "config.json: no target section"),
        (lambda c: c["method"].update(new_option=1), "config.json: method.new_option is not a "),
        (
            lambda c: c["specdraft"].pop("method"),
            "config.json: unknown draft kind None (specdraft.method)",
        ),
    ],
    ids=["no-target", "unknown-setting", "no-method"],
)
def test_a_draft_config_missing_a_section_or_with_settings_unknown_is_one_line(
    saved, target, tmp_path, capsys, edit, says
):
    """A draft config without its target, or with a setting this version does not know (a
    draft saved by a newer specdraft), was a KeyError or TypeError traceback, in
    specdraft-export and in specdraft-eval's ``draft=`` alike."""
    from decoding.drafts import load_proposer
    from models.base import DraftError

    draft = tmp_path / "final"
    shutil.copytree(saved, draft)
    cfg = json.loads((draft / "config.json").read_text())
    edit(cfg)
    (draft / "config.json").write_text(json.dumps(cfg))
    assert says in refused(capsys, str(draft), "--format", "vllm")
    with pytest.raises(DraftError) as e:
        load_proposer(str(draft), target)
    assert says in str(e.value)


def test_a_shipped_draft_exports_by_name_and_never_into_its_folder(
    saved, tmp_path, monkeypatch, capsys
):
    """``specdraft-export <shipped name>`` takes the name as specdraft-eval does; without --out
    it is refused (its default, beside the draft, is inside the package's shipped folder)."""
    from models import shipped

    folder = tmp_path / "shipped" / "tiny-e3"
    shutil.copytree(saved, folder)
    monkeypatch.setitem(shipped.SHIPPED, "tiny-e3", folder)
    for given in ("tiny-e3", str(folder)):
        assert "a draft shipped with specdraft" in refused(capsys, given, "--format", "vllm")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    out = tmp_path / "e3-vllm"
    main(["tiny-e3", "--format", "vllm", "--dtype", "float32", "--out", str(out)])
    assert detect_format(out) == "vllm"


def test_force_keeps_files_put_in_an_earlier_export(target, tmp_path):
    """--force replaces an earlier export, not the files put in its folder since (the target's
    GGUF beside the draft's, notes): those are named and kept."""
    out = tmp_path / "e"
    export(eagle3(target), "vllm", out, dtype="float32", log=quiet)
    (out / "target.gguf").write_bytes(b"the user's file")
    with pytest.raises(ExportError, match=r"earlier export with files it did not write \(target"):
        export(
            eagle3(target),
            "vllm",
            out,
            dtype="float32",
            force=True,
            log=quiet,
        )
    assert (out / "target.gguf").read_bytes() == b"the user's file"
    (out / "target.gguf").unlink()
    export(
        eagle3(target),
        "speculators",
        out,
        dtype="float32",
        force=True,
        log=quiet,
    )
    assert detect_format(out) == "speculators"


def test_an_earlier_export_that_cannot_be_deleted_whole_is_replaced_whole(
    target, tmp_path, monkeypatch
):
    """Replacing an earlier export deleted it before the new one was moved in: a file there
    that could not be deleted left half of it and no new export. The earlier export is moved
    aside first now; the new one lands whole."""
    out = tmp_path / "e"
    export(eagle3(target), "vllm", out, dtype="float32", log=quiet)
    readme = out / "README.md"
    readme.write_text(readme.read_text() + "\n<!-- kept by the file system -->\n")
    real = shutil.rmtree

    def rmtree(path, ignore_errors=False, **kw):
        """A folder holding that README: everything else goes, the README stays."""
        stuck = [f for f in Path(path).rglob("README.md") if "kept by" in f.read_text()]
        if not stuck:
            return real(path, ignore_errors=ignore_errors, **kw)
        for f in Path(path).rglob("*"):
            if f.is_file() and f not in stuck:
                f.unlink()
        if not ignore_errors:
            raise PermissionError(13, "Operation not permitted", str(stuck[0]))

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    export(
        eagle3(target),
        "speculators",
        out,
        dtype="float32",
        force=True,
        log=quiet,
    )
    assert detect_format(out) == "speculators"
    assert "kept by" not in readme.read_text()


# ------------------------------------------------------------------------------ ship_draft


def _ship(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """``scripts/ship_draft.py args``: its exit status, stdout and stderr."""
    return script_outcome("ship_draft", monkeypatch, capsys, *args)


@pytest.fixture
def shipped_to(saved, tmp_path, monkeypatch) -> Path:
    """A shipped name ``tiny-e3`` whose folder is a copy of ``saved`` with hand-written decode
    settings, as the repository's shipped drafts carry them."""
    import ship_draft

    dst = tmp_path / "shipped" / "tiny-e3"
    shutil.copytree(saved, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["decode"] = {"cpu_fp32": {"tree": "chain", "gamma": 4}}
    cfg["decode_note"] = "measured on this machine"
    (dst / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setitem(ship_draft.SHIPPED, "tiny-e3", dst)
    return dst


def test_ship_draft_keeps_the_shipped_decode_settings(saved, shipped_to, monkeypatch, capsys):
    """Shipping a new head for the same target copied the draft's config.json over the shipped
    one, dropping the decode settings specdraft-eval uses for the name, without a word."""
    rc, out, _ = _ship(monkeypatch, capsys, str(saved), "tiny-e3")
    assert rc == 0
    cfg = json.loads((shipped_to / "config.json").read_text())
    assert cfg["decode"] == {"cpu_fp32": {"tree": "chain", "gamma": 4}}
    assert cfg["decode_note"] == "measured on this machine"
    assert "kept the decode settings" in out
    rc, out, _ = _ship(monkeypatch, capsys, str(saved), "tiny-e3", "--new-target")
    assert rc == 0 and "decode" not in json.loads((shipped_to / "config.json").read_text())


def test_ship_draft_refuses_a_draft_it_would_ship_in_part(saved, shipped_to, tmp_path):
    """A Medusa-2 draft keeps its LoRA adapter beside its weights: shipped without it, the
    draft did not load."""
    from ship_draft import checked_draft

    medusa2 = tmp_path / "m2" / "final"
    shutil.copytree(saved, medusa2)
    cfg = json.loads((medusa2 / "config.json").read_text())
    cfg["specdraft"]["method"] = "medusa2"
    (medusa2 / "config.json").write_text(json.dumps(cfg))
    (medusa2 / "adapter").mkdir()
    (medusa2 / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        checked_draft(medusa2.parent, shipped_to, False)
    assert "a medusa2 draft keeps adapter beside its weights" in str(e.value.code)


def test_ship_draft_inputs_are_one_line(saved, shipped_to, tmp_path, monkeypatch, capsys):
    """Damaged weights and the shipped folder given as the draft to ship were tracebacks; a
    draft given as ``~/...`` was not found."""
    before = (shipped_to / "model.safetensors").read_bytes()
    bad = tmp_path / "bad" / "final"
    shutil.copytree(saved, bad)
    (bad / "model.safetensors").write_bytes(b"not safetensors")
    rc, _, _ = _ship(monkeypatch, capsys, str(bad), "tiny-e3")
    assert "model.safetensors: cannot read weights" in str(rc)
    rc, _, _ = _ship(monkeypatch, capsys, str(shipped_to), "tiny-e3")
    assert "is the shipped draft tiny-e3 itself" in str(rc)
    assert (shipped_to / "model.safetensors").read_bytes() == before
    monkeypatch.setenv("HOME", str(tmp_path))
    rc, _, _ = _ship(monkeypatch, capsys, "~/bad", "tiny-e3")
    assert "bad/final/model.safetensors: cannot read weights" in str(rc)  # found, not "no such"
