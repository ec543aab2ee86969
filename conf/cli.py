"""The command line of a Hydra command, checked before Hydra runs it: a key that names no
setting, or a value of the wrong type, is one line naming the key (Hydra's own message spans a
screen and exits 1), and ``+key=value`` adding a key the typed schema lacks is refused (Hydra
takes it and the command would silently ignore it).

Each command calls ``check_command_line(<its config name>, sys.argv[1:])`` once its schema is
registered; a sweep (``-m``) is left to Hydra, its values being lists.

How a long command stops (``StopSignals``): SIGINT (Ctrl-C) and SIGTERM (a scheduler's stop)
end it at its next boundary, a training step or a prompt, where what it holds is consistent:
it keeps what it has (a checkpoint, a report over the prompts finished) and exits with 128 +
the signal, as shells count (130, 143). A second signal stops it at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import signal
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent


def _overrides(argv: list[str], of_hydra: bool = False) -> list[str] | None:
    """The key=value arguments Hydra would apply to the command's config (``of_hydra``: to
    Hydra's own, ``hydra.*`` and ``hydra/<group>``), or None where the line is not a run's or
    a sweep's (another config, a help or print flag). A sweep's are its first job's (``a=1,2``:
    ``a=1``; a value swept by a function, ``range(...)``, is left to Hydra): a misspelled key is
    misspelled in every job."""
    flags = [a for a in argv if a.startswith("-")]
    if any(f not in ("-m", "--multirun") for f in flags):
        return None  # --cfg job, --config-name, --help, ...: Hydra's own
    ovs = [
        a for a in argv if "=" in a and a.lstrip("+~").startswith(("hydra.", "hydra/")) == of_hydra
    ]
    if flags:
        ovs = [o for o in map(_first_job, ovs) if o is not None]
    return ovs


_SWEEP_FUNCTIONS = ("range(", "choice(", "glob(", "interval(", "tag(", "sort(", "shuffle(")


def _first_job(override: str) -> str | None:
    """``key=a,b,c`` -> ``key=a`` (commas inside brackets or quotes are a value's own); None
    for a value a sweep function makes."""
    key, _, value = override.partition("=")
    if value.strip().startswith(_SWEEP_FUNCTIONS):
        return None
    depth, quote = 0, ""
    for i, ch in enumerate(value):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            return f"{key}={value[:i]}"
    return override


def _comma_in_a_path(argv: list[str]) -> str | None:
    """A one-line message for ``key=a,b`` whose whole value names a file or folder that is
    there (``data.path=chats,v2.jsonl``): a sweep would run one job on ``chats`` and one on
    ``v2.jsonl``, and a single run refuses it as ambiguous. Quoted, it names the file."""
    for a in argv:
        key, eq, value = a.partition("=")
        if not eq or a.startswith("-") or _first_job(a) in (None, a):
            continue
        if Path(value).expanduser().exists():
            return (
                f"{a}: {value} is there, and a comma separates a sweep's values; quote it to name "
                f"it (in a shell: '{key}=\"{value}\"')"
            )
    return None


def home_expanded(argv: list[str]) -> list[str]:
    """``key=~/path`` with ``~`` expanded to the home folder, as a shell does for a word of its
    own: a value starting with ``~`` is not in Hydra's grammar (its error reads
    ``LexerNoViableAltException``), and shells leave ``~`` after ``=`` alone. Each value of a
    sweep's list (``key=~/a,~/b``) too; ``~key`` (Hydra's delete) is a key's, not a value's."""
    out = []
    for a in argv:
        key, eq, value = a.partition("=")
        if eq and not a.startswith("-") and "~" in value:
            value = ",".join(
                os.path.expanduser(v) if v == "~" or v.startswith(("~/", "~" + os.sep)) else v
                for v in value.split(",")
            )
            a = f"{key}={value}"
        out.append(a)
    return out


def _unknown_keys(node, prefix: str = "") -> list[str]:
    """Keys of ``node`` (a composed config) that its typed schema does not declare."""
    from omegaconf import DictConfig, OmegaConf

    t = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(t):
        return []  # a free-form mapping (engine_args, ...): any key is the user's
    fields = {f.name for f in dataclasses.fields(t)}
    out = []
    for k in node.keys():
        if k not in fields:
            out.append(f"{prefix}{k}")
            continue
        child = node._get_node(k)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            out += _unknown_keys(child, f"{prefix}{k}.")
    return out


def _known(node, dotted: str) -> list[str]:
    """The keys beside ``dotted`` in ``node``: what a misspelled key may have meant."""
    from omegaconf import DictConfig

    *parents, _ = dotted.split(".")
    for p in parents:
        child = node._get_node(p) if isinstance(node, DictConfig) and p in node else None
        if not isinstance(child, DictConfig):
            return []
        node = child
    if not isinstance(node, DictConfig):
        return []
    return [d for d in (".".join([*parents, k]) for k in node.keys()) if d != dotted]


def _named(override: str, said: str) -> bool:
    """Whether Hydra's message ``said`` is about ``override``."""
    key = override.split("=", 1)[0].lstrip("+~")
    return override in said or f"'{key}'" in said or f"'{key}/" in said


def _did_you_mean(key: str, known: list[str]) -> str:
    leaves = {k.rsplit(".", 1)[-1]: k for k in known}
    near = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaves), n=1, cutoff=0.7)
    return f"; did you mean {leaves[near[0]]}?" if near else ""


#: Hydra's mode flags, of which a command line may hold one (Hydra's own refusal is a traceback)
_MODES = {
    "-r": "--run",
    "--run": "--run",
    "-m": "--multirun",
    "--multirun": "--multirun",
    "-c": "--cfg",
    "--cfg": "--cfg",
    "-i": "--info",
    "--info": "--info",
    "-sc": "--shell-completion",
    "--shell-completion": "--shell-completion",
}


def _modes(argv: list[str]) -> str | None:
    """A one-line refusal where ``argv`` asks Hydra for two modes at once, or None."""
    modes = sorted({_MODES[a.split("=", 1)[0]] for a in argv if a.split("=", 1)[0] in _MODES})
    if len(modes) < 2:
        return None
    if modes == ["--cfg", "--multirun"]:
        return (
            "-m with --cfg: Hydra prints one job's config, not a sweep's; drop -m and give one "
            "value per key (e.g. method=eagle3 --cfg job)"
        )
    return f"{' and '.join(modes)}: Hydra takes one of them at a time"


def _options(said: str) -> list[str]:
    """The options Hydra's "Could not find" message lists for a group (not its schemas)."""
    lines = said.split("Available options in", 1)[-1].splitlines()[1:]
    listed = lines[: next((i for i, x in enumerate(lines) if x[:1] != "\t"), len(lines))]
    return [x.strip() for x in listed if not x.strip().endswith("_schema")]


def _refusal(e: Exception, overrides: list[str], composed) -> str:
    """One line for Hydra's refusal ``e`` of ``overrides``, naming the one it is about."""
    cause = e.__cause__ or e
    text = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    bad = next((o for o in overrides if _named(o, str(e))), None)
    if bad is None:
        return text
    key, _, value = bad.lstrip("+~").partition("=")
    if "Ambiguous value" in text:  # a comma without -m
        return (
            f"{bad}: a comma separates a sweep's values; add -m to run one job per value, or "
            "give one value (a list in brackets: key=[a,b]; a text with a comma in quotes, in a "
            "shell: 'key=\"a,b\"')"
        )
    if "Could not find" in text:  # no such option of a group (Hydra's own groups too)
        group = key.rsplit("/", 1)[-1]
        msg = f"{bad}: no such {group} (choose from {', '.join(_options(str(e)))})"
        if key in ("hydra/launcher", "hydra/sweeper"):  # Hydra's plugins are packages
            msg += f"; it is a package of its own: pip install hydra-{value.split('_')[0]}-{group}"
        return msg
    if "not in" in text:  # no such key
        try:
            known = _known(composed([o for o in overrides if o != bad]), key)
        except Exception:
            known = []
        return f"{bad}: no such setting{_did_you_mean(key, known)}"
    return f"{bad}: {text}"


def check_command_line(config_name: str, argv: list[str]) -> str | None:
    """A one-line message for the first key=value that does not compose (the command's keys
    first, then Hydra's own), or None."""
    two = _modes(argv)
    if two is not None:
        return two
    comma = _comma_in_a_path(argv)
    if comma is not None:
        return comma
    overrides = _overrides(argv)
    if overrides is None:
        return None
    of_hydra = _overrides(argv, of_hydra=True) or []
    if not overrides and not of_hydra:
        return None
    from hydra import compose, initialize_config_dir

    def composed(ovs: list[str], with_hydra: bool = False):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name, overrides=ovs, return_hydra_config=with_hydra)

    try:
        cfg = composed(overrides)
    except Exception as e:  # Hydra wraps OmegaConf's error; its cause names the key
        return _refusal(e, overrides, composed)
    extra = _unknown_keys(cfg)
    if extra:
        hint = _did_you_mean(extra[0], _known(cfg, extra[0]))
        return f"+{extra[0]}: no such setting (the command would ignore it){hint}"
    if of_hydra:  # hydra.run.dirr=x, hydra/launcher=<a plugin not installed>: a screen each
        every = [*overrides, *of_hydra]
        try:
            composed(every, with_hydra=True)
        except Exception as e:
            return _refusal(e, of_hydra, lambda ovs: composed([*overrides, *ovs], True))
    return None


class Stopped(KeyboardInterrupt):
    """A command stopped by a signal at once (not at a boundary); ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def exit_code_of(e: KeyboardInterrupt) -> int:
    """128 + the signal behind an interruption (a plain KeyboardInterrupt is SIGINT's)."""
    return e.exit_code if isinstance(e, Stopped) else 128 + signal.SIGINT


class StopSignals:
    """SIGINT and SIGTERM, while inside ``with StopSignals(...)``:

    - ``deferred`` (a loop that checks ``caught`` at its boundaries): the first signal sets
      ``caught`` and prints ``notice`` (one raw write, safe beside a progress bar); the loop
      ends at its next boundary. A second raises ``Stopped`` at once.
    - not deferred (work with no boundary to stop at): the first raises ``Stopped``.

    A SIGINT the process was started ignoring (a background job of a non-interactive shell)
    stays ignored, as Python itself leaves it; SIGTERM is always taken. Outside the main thread
    (where signals cannot be set) nothing is installed. The previous handlers come back on
    exit, so a nested ``StopSignals`` rules while it is open."""

    #: the signal this process was last stopped by (its exit status says so: 128 + it)
    last: int | None = None
    #: the open ones, innermost last (signals are the process's: so is this)
    _open: list[StopSignals] = []

    def __init__(self, deferred: bool = True, notice: str = ""):
        self.deferred = deferred
        self.notice = notice
        self.caught: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for s in (signal.SIGINT, signal.SIGTERM):
            if s == signal.SIGINT and signal.getsignal(s) == signal.SIG_IGN:
                continue
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread (e.g. some launchers): leave defaults
                pass
        StopSignals._open.append(self)
        return self

    @classmethod
    def requested(cls) -> int | None:
        """The signal that asked the innermost open ``StopSignals`` to stop, or None: what a
        loop deep in a command checks at its boundaries."""
        return cls._open[-1].caught if cls._open else None

    def _handle(self, signum, frame) -> None:
        first = self.caught is None
        self.caught = StopSignals.last = signum
        if not self.deferred or not first:
            raise Stopped(signum)
        if self.notice:
            os.write(2, f"\n{signal.Signals(signum).name}: {self.notice}\n".encode())

    def __exit__(self, *exc) -> None:
        StopSignals._open.remove(self)
        for s, h in self._old.items():
            signal.signal(s, h)
