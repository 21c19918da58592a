"""Bad input gets one clear error naming the problem, never a traceback, and deletes nothing.

Each case is checked three ways: the library API (the exception type and its message), the CLI's
``main()`` in this process (exit code, one ``smartckpt: error:`` line on stderr) and the CLI as a
real ``python -m smartckpt_cli.cli.app`` process. Every case snapshots the directory tree (file
sizes and mtimes) before and after and requires every file to survive unchanged.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from smartckpt_cli import (
    CheckpointManager,
    JournalError,
    NotAStoreError,
    SmartckptError,
    StateMismatchError,
    StoreNotFoundError,
)
from smartckpt_cli.cli import app as cli_app
from smartckpt_cli.errors import EXIT_ERROR, EXIT_USAGE
from smartckpt_cli.store.journal import decode_line, encode_line

pytestmark = pytest.mark.usefixtures("isolated")

REPO = Path(__file__).resolve().parents[1]
LOCKS = {"writer.lock", "journal.lock"}  # opening a store for writing may create these

# ---------------------------------------------------------------------------- helpers


def _tree(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every path under ``root`` (root included): (kind, size, mtime_ns); dirs only by kind."""
    out: dict[str, tuple[str, int, int]] = {}
    for p in [root, *root.rglob("*")]:
        st = p.lstat()
        rel = str(p.relative_to(root))
        out[rel] = ("dir", 0, 0) if p.is_dir() else ("file", st.st_size, st.st_mtime_ns)
    return out


def _assert_nothing_lost(
    before: dict[str, tuple[str, int, int]],
    after: dict[str, tuple[str, int, int]],
    locks_may_change: bool = False,
) -> None:
    """Every path in ``before`` is in ``after``, unchanged; nothing new appears, except lock
    files (created or rewritten by opening a store for writing) when ``locks_may_change``."""
    if locks_may_change:
        before = {k: v for k, v in before.items() if Path(k).name not in LOCKS}
        after = {k: v for k, v in after.items() if Path(k).name not in LOCKS}
    changed = {k: (v, after.get(k)) for k, v in before.items() if after.get(k) != v}
    assert not changed, f"files changed or deleted: {changed}"
    new = sorted(k for k in after if k not in before)
    assert not new, f"unexpected new files: {new}"


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}


def _make_store(path: Path, model: torch.nn.Module | None = None) -> torch.nn.Module:
    """A real store with one checkpoint (step 1) of ``model``."""
    model = model or torch.nn.Linear(8, 16)
    with CheckpointManager(path, chunk_mb=1) as mgr:
        mgr.register(model=model)
        assert mgr.save(1, blocking=True).wait() is not None
    return model


# ---------------------------------------------------------------------------- the cases


@dataclass
class Case:
    error: type[SmartckptError]
    exit_code: int
    target: Path  # what the user names on the command line
    words: tuple[str, ...]  # what the one line must say
    root: Path  # the tree that must survive


def _case_missing(base: Path) -> Case:
    base.mkdir()
    (base / "other.txt").write_text("unrelated\n")
    missing = base / "no-such-run"
    return Case(StoreNotFoundError, EXIT_USAGE, missing, (str(missing), "does not exist"), base)


def _case_missing_bracketed(base: Path) -> Case:
    """Paths with brackets must be printed as they are (rich markup must not eat them)."""
    base.mkdir()
    missing = base / "exp[lr=1e-3]" / "[/]ckpt"
    return Case(StoreNotFoundError, EXIT_USAGE, missing, (str(missing), "does not exist"), base)


def _case_not_a_store(base: Path) -> Case:
    d = base / "project"
    (d / "data").mkdir(parents=True)
    (d / "train.py").write_text("print('hello')\n")
    (d / "data" / "x.bin").write_bytes(os.urandom(1000))
    return Case(NotAStoreError, EXIT_USAGE, d, (str(d), "not a smartckpt checkpoint store"), base)


def _case_a_file(base: Path) -> Case:
    base.mkdir()
    f = base / "model.pt"
    f.write_bytes(b"not a directory")
    return Case(NotAStoreError, EXIT_USAGE, f, (str(f), "is not a directory"), base)


def _case_garbage_journal(base: Path) -> Case:
    store = base / "store"
    _make_store(store)
    rng = random.Random(7)
    (store / "journal.jsonl").write_bytes(bytes(rng.randrange(256) for _ in range(3000)))
    journal = store / "journal.jsonl"
    return Case(JournalError, EXIT_ERROR, store, (str(journal), "not a smartckpt journal"), base)


def _case_journal_is_a_directory(base: Path) -> Case:
    store = base / "store"
    _make_store(store)
    (store / "journal.jsonl").unlink()
    (store / "journal.jsonl").mkdir()
    (store / "journal.jsonl" / "keep.txt").write_text("do not delete\n")
    journal = store / "journal.jsonl"
    return Case(JournalError, EXIT_ERROR, store, (f"cannot read journal {journal}",), base)


def _case_newer_journal(base: Path) -> Case:
    store = base / "store"
    store.mkdir(parents=True)
    init = {"event": "init", "format": "smartckpt-journal", "v": 99, "store_id": "f" * 32}
    (store / "journal.jsonl").write_bytes(encode_line(init))
    return Case(JournalError, EXIT_ERROR, store, ("journal version 99", "upgrade smartckpt"), base)


CASES = {
    "missing": _case_missing,
    "missing-bracketed": _case_missing_bracketed,
    "not-a-store": _case_not_a_store,
    "a-file": _case_a_file,
    "garbage-journal": _case_garbage_journal,
    "journal-is-a-directory": _case_journal_is_a_directory,
    "newer-journal": _case_newer_journal,
}
# The CLI as a real process costs ~3 s of CPU (torch import) per run: these run concurrently.
SUBPROCESS_CASES = {"missing": "verify", "not-a-store": "inspect", "garbage-journal": "verify"}


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Case:
    return CASES[request.param](tmp_path / "case")


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Case, Any, dict, dict]]:
    procs = {}
    for name, command in SUBPROCESS_CASES.items():
        base = tmp_path_factory.mktemp(name)
        c = CASES[name](base / "case")
        before = _tree(c.root)
        proc = subprocess.Popen(
            [sys.executable, "-m", "smartckpt_cli.cli.app", command, str(c.target)],
            cwd=base,
            env={**_clean_env(), "PYTHONPATH": str(REPO), "COLUMNS": "60"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs[name] = (c, proc, before)
    out = {}
    for name, (c, proc, before) in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[name] = (c, (proc.returncode, stdout, stderr), before, _tree(c.root))
    return out


def _assert_one_error_line(stderr: str, c: Case) -> None:
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{stderr}"
    assert lines[0].startswith("smartckpt: error: "), lines[0]
    for word in c.words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"


# ---------------------------------------------------------------------------- API


def test_api_raises_one_clear_error_and_deletes_nothing(case: Case) -> None:
    before = _tree(case.root)
    with pytest.raises(case.error) as err:
        CheckpointManager(case.target, create=False)
    for word in case.words:
        assert word in str(err.value)
    assert "\n" not in str(err.value)
    _assert_nothing_lost(before, _tree(case.root), locks_may_change=case.error is JournalError)
    if case.error is StoreNotFoundError:
        assert not case.target.exists()


def test_api_error_is_the_same_on_retry(case: Case) -> None:
    """A failed open leaves no lock behind: the retry gets the same error, not StoreLockedError
    naming this very process."""
    for _ in range(2):
        with pytest.raises(case.error):
            CheckpointManager(case.target, create=False)


def test_default_create_does_not_touch_a_file_or_a_bad_journal(tmp_path: Path) -> None:
    """Without create=False the manager may create a store, but never over a file or over a
    journal it cannot read."""
    for factory in (_case_a_file, _case_garbage_journal):
        c = factory(tmp_path / factory.__name__)
        before = _tree(c.root)
        with pytest.raises(c.error):
            CheckpointManager(c.target)
        _assert_nothing_lost(before, _tree(c.root), locks_may_change=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_journal(tmp_path: Path) -> None:
    store = tmp_path / "store"
    _make_store(store)
    (store / "journal.jsonl").chmod(0)
    try:
        before = _tree(tmp_path)
        with pytest.raises(JournalError, match=r"cannot read journal .*Permission denied"):
            CheckpointManager(store, create=False)
        _assert_nothing_lost(before, _tree(tmp_path), locks_may_change=True)
    finally:
        (store / "journal.jsonl").chmod(0o644)


# ---------------------------------------------------------------------------- CLI


def test_cli_main_prints_one_line_and_exits_with_the_error_code(
    case: Case, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _tree(case.root)
    monkeypatch.setattr(sys, "argv", ["smartckpt", "verify", str(case.target)])
    with pytest.raises(SystemExit) as exit_:
        cli_app.main()
    assert exit_.value.code == case.exit_code == case.error.exit_code
    out, err = capsys.readouterr()
    assert out == ""
    _assert_one_error_line(err, case)
    _assert_nothing_lost(before, _tree(case.root))


def test_cli_runner_surfaces_the_domain_error(case: Case) -> None:
    """The typer app itself raises the domain error; main() is what maps it to the exit code."""
    result = CliRunner().invoke(cli_app.app, ["inspect", str(case.target)])
    assert isinstance(result.exception, case.error), result.output
    assert result.output == ""


@pytest.mark.parametrize("name", list(SUBPROCESS_CASES))
def test_cli_process(name: str, cli_runs: dict[str, tuple[Case, Any, dict, dict]]) -> None:
    c, (code, stdout, stderr), before, after = cli_runs[name]
    assert code == c.exit_code, stderr
    assert stdout == ""
    _assert_one_error_line(stderr, c)
    _assert_nothing_lost(before, after)


# ---------------------------------------------------------------------------- shape mismatch


def test_shape_mismatch_names_key_and_shapes_and_leaves_model_unchanged(tmp_path: Path) -> None:
    store = tmp_path / "store"
    torch.manual_seed(0)
    _make_store(store, torch.nn.Linear(8, 16))
    before_tree = _tree(store)

    torch.manual_seed(1)
    model = torch.nn.Linear(8, 32)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with CheckpointManager(store, create=False) as mgr:
        mgr.register(model=model)
        with pytest.raises(StateMismatchError) as err:
            mgr.restore()
    msg = str(err.value)
    # Entries are checked in manifest order: whichever comes first is named, with both shapes.
    assert re.fullmatch(
        r"model/weight: checkpoint shape 16x8 does not match the model's 32x8"
        r"|model/bias: checkpoint shape 16 does not match the model's 32",
        msg,
    ), msg
    assert "\n" not in msg
    for key, want in weights.items():
        assert torch.equal(model.state_dict()[key], want), f"{key} was modified"
    assert torch.equal(torch.get_rng_state(), rng), "RNG was restored despite the mismatch"
    _assert_nothing_lost(before_tree, _tree(store), locks_may_change=True)
    # The checkpoint itself is fine: the right model restores from it.
    right = torch.nn.Linear(8, 16)
    with CheckpointManager(store, create=False) as mgr:
        mgr.register(model=right)
        assert mgr.restore() == 1


# ---------------------------------------------------------------------------- journal commands
#
# The bad-input list of the journal commands (inspect, verify, prune, rollback, export): a missing
# path, a file, a directory of unrelated files, a journal of garbage, a truncated blob, a
# permission-denied directory and ``--to``/``--step`` a step that does not exist. Each gives one
# line and its documented exit code, and the store's files are the same before and after.

JOURNAL_COMMANDS = {
    "inspect": lambda d, out: ["inspect", str(d)],
    "verify": lambda d, out: ["verify", str(d)],
    "prune": lambda d, out: ["prune", str(d), "--keep", "1"],
    "rollback": lambda d, out: ["rollback", str(d), "--to-prev"],
    "export": lambda d, out: ["export", str(d), str(out)],
}


def _truncated_blob_store(base: Path) -> tuple[Path, str]:
    """Two checkpoints; the newest one's first weight blob loses its last 100 bytes."""
    store = base / "store"
    model = torch.nn.Linear(64, 64)
    with CheckpointManager(store, chunk_mb=1) as mgr:
        mgr.register(model=model)
        assert mgr.save(1, blocking=True).wait() is not None
        with torch.no_grad():
            model.weight.add_(1.0)
        assert mgr.save(2, blocking=True).wait() is not None
    import json as _json

    from smartckpt_cli.store.directory import open_store

    rec = max(open_store(store).journal.read().live(), key=lambda r: r.position)
    manifest = _json.loads((store / rec.manifest).read_text())
    bid = manifest["entries"]["model/weight"]["data"]["chunks"][0][0]
    blob = store / "blobs" / bid[:2] / bid
    blob.write_bytes(blob.read_bytes()[:-100])
    return store, bid


def _main(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["smartckpt", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli_app.main()
    out, err = capsys.readouterr()
    return int(exit_.value.code or 0), out, err


@pytest.mark.parametrize("command", list(JOURNAL_COMMANDS))
@pytest.mark.parametrize("name", ["missing", "missing-bracketed", "not-a-store", "a-file", "garbage-journal"])
def test_journal_commands_refuse_bad_stores(
    name: str,
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    c = CASES[name](tmp_path / "case")
    out_file = tmp_path / "exported.pt"
    before = _tree(c.root)
    code, out, err = _main(JOURNAL_COMMANDS[command](c.target, out_file), monkeypatch, capsys)
    assert code == c.exit_code, err
    assert out == ""
    _assert_one_error_line(err, c)
    _assert_nothing_lost(before, _tree(c.root))
    assert not out_file.exists()


# What each command does with a store whose newest checkpoint has a truncated blob: inspect
# lists it (it reads no blob), verify names it (exit 1), prune refuses to count it as the newest
# verified one and keeps it (--keep 1 keeps it and step 1), rollback --to-prev is fine (the target,
# step 1, is sound), export refuses it (exit 1), naming step 1 as the one it can export.
TRUNCATED = {
    "inspect": (0, None),
    "verify": (
        1,
        r"^step 2 \(\w+\): CORRUPT: L1 entry model/weight: hash mismatch in blob {bid} \([\d,]+ bytes on disk\)$",
    ),
    # export without --step names the damage and the newest checkpoint that verifies
    "export": (
        1,
        r"^smartckpt: error: the newest checkpoint \(step 2\) is damaged: L1 entry model/weight: hash "
        r"mismatch in blob {bid}; the newest checkpoint that verifies is step 1: smartckpt export \S+ OUT --step 1$",
    ),
}


@pytest.mark.parametrize("command", list(TRUNCATED))
def test_truncated_blob(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store, bid = _truncated_blob_store(tmp_path / "case")
    out_file = tmp_path / "exported.pt"
    before = _tree(store)
    journal = (store / "journal.jsonl").read_bytes()
    code, out, err = _main(JOURNAL_COMMANDS[command](store, out_file), monkeypatch, capsys)
    want_code, pattern = TRUNCATED[command]
    if command == "verify":
        # verify only appends its finding ("verified" events, for inspect) to the journal
        grown = (store / "journal.jsonl").read_bytes()
        assert grown.startswith(journal)
        added = [decode_line(ln) for ln in grown[len(journal) :].splitlines()]
        assert [(e or {}).get("event") for e in added] == ["verified"]
        assert added[0] is not None and added[0]["ok"] is False and bid in added[0]["problem"]
        before.pop("journal.jsonl")
        (store / "journal.jsonl").write_bytes(journal)
        before["journal.jsonl"] = _tree(store)["journal.jsonl"]
        # ... and when each sound blob was last re-hashed (store/scrub.py), for inspect
        book = json.loads((store / "scrub.json").read_text())
        assert bid not in book["checked"] and len(book["checked"]) > 0
        if "scrub.json" in before:
            before["scrub.json"] = _tree(store)["scrub.json"]
        else:
            (store / "scrub.json").unlink()
    assert code == want_code, out + err
    assert "Traceback" not in out + err
    if pattern is not None:
        lines = (out + err).strip().splitlines()
        assert len(lines) == 1, lines
        assert re.match(pattern.format(bid=bid), lines[0]), lines[0]
    _assert_nothing_lost(before, _tree(store))
    assert not out_file.exists()


def test_truncated_blob_prune_keeps_the_corrupt_newest_and_the_newest_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store, bid = _truncated_blob_store(tmp_path / "case")
    before = _tree(store)
    code, out, err = _main(["prune", str(store), "--keep", "1"], monkeypatch, capsys)
    assert code == 0, err
    assert "nothing to prune" in out and "newest verified checkpoint: step 1" in out
    assert f"hash mismatch in blob {bid}" in err
    after = _tree(store)
    blobs_before = {k: v for k, v in before.items() if k.startswith("blobs/")}
    assert {k: after.get(k) for k in blobs_before} == blobs_before, "a blob was removed"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["rollback", "{d}", "--to", "7"], "no checkpoint of step 7 in this store (live steps: 2, 1)"),
        (["verify", "{d}", "--step", "7"], "no checkpoint of step 7 in this store (steps: 2, 1)"),
        (["inspect", "{d}", "--step", "7"], "no checkpoint of step 7 in this store (steps: 2, 1)"),
        (
            ["export", "{d}", "{out}", "--step", "7"],
            "no checkpoint of step 7 in this store (live steps: 2, 1)",
        ),
        (["rollback", "{d}", "--to", "2"], "step 2 is already what a resume loads"),
        (["prune", "{d}", "--keep", "0"], "--keep must be at least 1"),
    ],
)
def test_a_step_that_does_not_exist(
    argv: list[str],
    words: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = tmp_path / "store"
    model = torch.nn.Linear(4, 4)
    with CheckpointManager(store) as mgr:
        mgr.register(model=model)
        mgr.save(1, blocking=True).wait()
        mgr.save(2, blocking=True).wait()
    out_file = tmp_path / "out.pt"
    before = _tree(store)
    code, out, err = _main([a.format(d=store, out=out_file) for a in argv], monkeypatch, capsys)
    assert code == EXIT_USAGE and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"smartckpt: error: {words}"), lines
    _assert_nothing_lost(before, _tree(store))
    assert not out_file.exists()


def _without_dac_override() -> list[str]:
    """Run a command as root but without the capabilities that bypass file permissions, so a
    chmod 000 directory is really unreadable (the tests run as root here)."""
    import shutil

    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot drop CAP_DAC_OVERRIDE")
    return [setpriv, "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]


def test_permission_denied_directory_as_real_processes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    _make_store(store)
    prefix = _without_dac_override()
    before = _tree(store)
    store.chmod(0)
    try:
        procs = {
            name: subprocess.Popen(
                [*prefix, sys.executable, "-m", "smartckpt_cli.cli.app", *argv(store, tmp_path / "o.pt")],
                cwd=tmp_path,
                env={**_clean_env(), "PYTHONPATH": str(REPO)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name, argv in JOURNAL_COMMANDS.items()
        }
        results = {name: (*p.communicate(timeout=180), p.returncode) for name, p in procs.items()}
    finally:
        store.chmod(0o755)
    for name, (out, err, code) in results.items():
        assert code == EXIT_USAGE, (name, err)
        assert out == ""
        assert err.strip().splitlines() == [f"smartckpt: error: cannot open {store}: permission denied"], name
    _assert_nothing_lost(before, _tree(store))
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ["run", "--hang-timeout", "x", "train.py"],
            ["Invalid value for '--hang-timeout'", "(smartckpt run -h)"],
        ),
        (["--bogus"], ["No such option: --bogus", "(smartckpt -h)"]),
        (["inspect"], ["Missing argument", "(smartckpt inspect -h)"]),
        (["verify", "ck", "--step", "many"], ["Invalid value for '--step'"]),
        (["run", "--dir", "{file}", "{script}"], ["--dir", "is not a directory"]),
        (["run", "--bogus", "{script}"], ["no such option: --bogus", "smartckpt run -h"]),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    argv: list[str], words: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """What click would box in a panel and typer's usage hint is one line in the one format."""
    (tmp_path / "afile.txt").write_text("not a directory\n")
    (tmp_path / "train.py").write_text("print('hello')\n")
    argv = [a.format(file=tmp_path / "afile.txt", script=tmp_path / "train.py") for a in argv]
    code, out, err = _main(argv, monkeypatch, capsys)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("smartckpt: error: "), err
    for w in words:
        assert w in lines[0], lines[0]
    assert "Traceback" not in err and "╭" not in err
    assert (
        not (tmp_path / "afile.txt").is_dir() and (tmp_path / "afile.txt").read_text() == "not a directory\n"
    )


def test_version(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from smartckpt_cli.version import __version__

    code, out, err = _main(["--version"], monkeypatch, capsys)
    assert code == 0 and out.strip() == f"smartckpt {__version__}" and err == ""
