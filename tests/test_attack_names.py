"""Nothing read from a store, a remote or a run directory reaches outside it.

A table of attacks, each on a copy of one real store (a tiny training, four checkpoints, replicated
to a ``file://`` remote): every string (and number) field of every object smartckpt reads back —
journal lines with their crc recomputed, manifests with their hash fixed up in the commit line,
remote journal objects and their names, part markers, the uploader's status file, run records —
is replaced by absolute paths, ``..`` paths, paths that go in then out, over-long names, NULs and
non-UTF-8 names; symlinks pointing outside are planted for the store's folders and files. Then
every command that reads it runs: ``prune``, ``verify --all``, ``inspect``, ``rollback``,
``export``, ``plot --json``, ``verify``/``prune --remote``, ``restore()`` and a restore from the
remote onto an empty disk.

Each case asserts: no file outside the store and the remote prefix is created, changed or
deleted (every file of the sandbox is hashed before and after); no command ends in an exception
other than smartckpt's one-line errors; every exit code is a documented one. The headline cases
(a journal line naming a file outside for ``prune``, a remote commit naming one for a restore onto
a wiped node) are also run through the real ``smartckpt`` command in a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from smartckpt_cli import CheckpointManager
from smartckpt_cli.cli.app import app
from smartckpt_cli.errors import SmartckptError
from smartckpt_cli.store import codec
from smartckpt_cli.store.journal import decode_line, encode_line

runner = CliRunner()

STORE = "node/store"
REMOTE = "bucket/a/prefix"
CANARY = "outside/precious.json"


# ---------------------------------------------------------------------------- the template


def _train(store: Path, remote: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mgr = CheckpointManager(store, keep_last=10, remote=f"file://{remote}", remote_close_wait=60)
    mgr.register(model=model, optimizer=opt)
    for step in range(1, 5):
        opt.zero_grad()
        model(torch.randn(8, 6)).pow(2).mean().backward()
        opt.step()
        mgr.save(step, blocking=True)
    assert mgr.close() == []


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("attack-template")
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("SMARTCKPT_")]:
            mp.delenv(name)
        mp.chdir(root)
        _train(root / STORE, root / REMOTE)
    (root / "outside").mkdir()
    (root / CANARY).write_text('{"precious": true}')
    (root / "outside" / "m.json").write_text('{"also": "precious"}')
    (root / "outside" / "dir").mkdir()
    (root / "outside" / "dir" / "keep.bin").write_bytes(b"\x01" * 64)
    (root / STORE / "runs").mkdir()
    (root / STORE / "runs" / "20261206-000000-abcdef.json").write_text(
        json.dumps(
            {"run_id": "20261206-000000-abcdef", "command": ["train.py"], "directory": ".", "started": 1.0}
        )
    )
    assert len(list((root / REMOTE / "journal").iterdir())) >= 5, "the remote holds the commits"
    return root


@pytest.fixture
def case(template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "case"
    shutil.copytree(template, root, symlinks=True)
    for name in [n for n in os.environ if n.startswith("SMARTCKPT_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(root)
    return root


# ---------------------------------------------------------------------------- rewriting what is read


def _events(path: Path) -> list[dict[str, Any]]:
    return [e for e in (decode_line(x) for x in path.read_bytes().splitlines()) if e is not None]


def _write_events(path: Path, events: list[dict[str, Any]]) -> None:
    path.write_bytes(b"".join(encode_line(e) for e in events))  # crc recomputed: anyone can


def _commits(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "commit"]


def journal_field(field: str, which: int = -1) -> Callable[[Path, Any], None]:
    """Set ``field`` of a local commit line (the newest, or the oldest with which=0)."""

    def attack(root: Path, value: Any) -> None:
        path = root / STORE / "journal.jsonl"
        events = _events(path)
        _commits(events)[which][field] = value
        _write_events(path, events)

    return attack


def journal_parts(root: Path, value: Any) -> None:
    """A multi-rank commit line whose rank-1 part names ``value``."""
    path = root / STORE / "journal.jsonl"
    events = _events(path)
    ev = _commits(events)[-1]
    ev["parts"] = [[ev["manifest"], ev["manifest_hash"], "d" * 16], [value, ev["manifest_hash"], "d" * 16]]
    ev["world_size"] = 2
    _write_events(path, events)


def journal_event(kind: str, field: str) -> Callable[[Path, Any], None]:
    def attack(root: Path, value: Any) -> None:
        path = root / STORE / "journal.jsonl"
        events = _events(path)
        if kind == "init":
            events[0][field] = value
        else:
            events.append({"event": kind, field: value if field != "ids" else [value]})
        _write_events(path, events)

    return attack


def _manifest_attack(
    root: Path,
    base: Path,
    journal: Callable[[], list[tuple[Path | None, dict[str, Any]]]],
    mutate: Callable[[dict[str, Any]], None],
) -> None:
    """Change the newest checkpoint's manifest and fix its hash up in the commit line."""
    commits = journal()
    where, ev = commits[-1]
    manifest = json.loads((base / ev["manifest"]).read_bytes())
    mutate(manifest)
    data = json.dumps(manifest).encode()
    (base / ev["manifest"]).write_bytes(data)
    ev["manifest_hash"] = codec.blob_id(data)
    if where is None:
        path = root / STORE / "journal.jsonl"
        events = _events(path)
        _commits(events)[-1]["manifest_hash"] = ev["manifest_hash"]
        _write_events(path, events)
    else:
        where.write_bytes(encode_line(ev))


def _local_commits(root: Path) -> Callable[[], list[tuple[Path | None, dict[str, Any]]]]:
    return lambda: [(None, e) for e in _commits(_events(root / STORE / "journal.jsonl"))]


def _remote_commits(root: Path) -> Callable[[], list[tuple[Path | None, dict[str, Any]]]]:
    def read() -> list[tuple[Path | None, dict[str, Any]]]:
        out: list[tuple[Path | None, dict[str, Any]]] = []
        for p in sorted((root / REMOTE / "journal").iterdir()):
            ev = decode_line(p.read_bytes().strip())
            if ev is not None and ev.get("event") == "commit":
                out.append((p, ev))
        return out

    return read


def _first_entry(manifest: dict[str, Any]) -> dict[str, Any]:
    return next(iter(manifest["entries"].values()))


def manifest_blob(side: str) -> Callable[[Path, Any], None]:
    def attack(root: Path, value: Any) -> None:
        base = root / (STORE if side == "local" else REMOTE)
        commits = _local_commits(root) if side == "local" else _remote_commits(root)

        def mutate(m: dict[str, Any]) -> None:
            _first_entry(m)["data"]["chunks"][0][0] = value

        _manifest_attack(root, base, commits, mutate)

    return attack


def manifest_ref(root: Path, value: Any) -> None:
    def mutate(m: dict[str, Any]) -> None:
        _first_entry(m)["ref"] = value

    _manifest_attack(root, root / STORE, _local_commits(root), mutate)


def manifest_meta(root: Path, value: Any) -> None:
    def mutate(m: dict[str, Any]) -> None:
        m["meta"] = value
        m["objects"] = {"model": value}

    _manifest_attack(root, root / STORE, _local_commits(root), mutate)


def remote_field(field: str) -> Callable[[Path, Any], None]:
    """Set ``field`` of the remote's newest commit object (the body's crc recomputed). For the
    manifest the named object is also planted where it points, so that it can be fetched."""

    def attack(root: Path, value: Any) -> None:
        where, ev = _remote_commits(root)()[-1]
        if (
            field == "manifest"
            and isinstance(value, str)
            and not value.startswith("/")
            and "\x00" not in value
        ):
            target = root / REMOTE / value
            if ".." in value and len(value) < 200:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes((root / REMOTE / ev["manifest"]).read_bytes())
        ev[field] = value
        assert where is not None
        where.write_bytes(encode_line(ev))

    return attack


def remote_object_name(root: Path, value: Any) -> None:
    """A journal object of somebody else's under the prefix (a name that is not the format's),
    whose body names ``value``."""
    _, ev = _remote_commits(root)()[-1]
    name = str(value).replace("/", "_").replace("\x00", "_")[:200] or "x"
    body = {**ev, "manifest": value, "step": ev["step"] + 100}
    try:
        (root / REMOTE / "journal" / f"000000000099-commit-{name}").write_bytes(encode_line(body))
    except (OSError, UnicodeEncodeError):
        (root / REMOTE / "journal" / "000000000099-commit-zz.json").write_bytes(encode_line(body))


def part_marker(root: Path, value: Any) -> None:
    parts = root / REMOTE / "parts"
    parts.mkdir(exist_ok=True)
    name = str(value).replace("/", "_").replace("\x00", "_")[:200] or "x"
    try:
        (parts / name).write_text("{}")
    except (OSError, UnicodeEncodeError):
        (parts / "x.json").write_text("{}")


def status_file(field: str) -> Callable[[Path, Any], None]:
    def attack(root: Path, value: Any) -> None:
        body = {"remote": "file:///x", "world": 1, "pending": 0, "pending_steps": [], "lag_seconds": 0.0}
        body[field] = value
        (root / STORE / "remote-status.json").write_text(json.dumps(body))
        if field == "world":
            (root / STORE / "remote-status-r1.json").write_text(json.dumps({**body, "world": 1}))

    return attack


def run_record(field: str) -> Callable[[Path, Any], None]:
    def attack(root: Path, value: Any) -> None:
        path = root / STORE / "runs" / "20261206-000000-abcdef.json"
        body = json.loads(path.read_text())
        if field == "attempts":
            body["attempts"] = [
                {"attempt": 0, "pid": 1, "started": 1.0, "start_step": value, "stacks": value}
            ]
        else:
            body[field] = value
        path.write_text(json.dumps(body))

    return attack


FIELDS: dict[str, Callable[[Path, Any], None]] = {
    "journal commit manifest": journal_field("manifest"),
    "journal commit manifest (oldest)": journal_field("manifest", 0),
    "journal commit id": journal_field("id"),
    "journal commit id (oldest)": journal_field("id", 0),
    "journal commit step": journal_field("step"),
    "journal commit manifest_hash": journal_field("manifest_hash"),
    "journal commit parts": journal_parts,
    "journal commit world_size": journal_field("world_size"),
    "journal init store_id": journal_event("init", "store_id"),
    "journal rollback to_step": journal_event("rollback", "to_step"),
    "journal prune ids": journal_event("prune", "ids"),
    "manifest chunk blob id": manifest_blob("local"),
    "manifest entry ref": manifest_ref,
    "manifest meta and objects": manifest_meta,
    "remote commit manifest": remote_field("manifest"),
    "remote commit id": remote_field("id"),
    "remote commit parts": remote_field("parts"),
    "remote manifest chunk blob id": manifest_blob("remote"),
    "remote journal object name": remote_object_name,
    "remote part marker name": part_marker,
    "status file world": status_file("world"),
    "status file lag": status_file("lag_seconds"),
    "run record attempts": run_record("attempts"),
    "run record directory": run_record("directory"),
}

PAYLOADS: dict[str, Any] = {
    "absolute": "{ROOT}/" + CANARY,
    "dotdot": "../../outside/precious.json",
    "in then out": "manifests/../../../outside/precious.json",
    "remote in then out": "manifests/../../../outside/m.json",
    "over-long": "manifests/" + "a" * 5000 + ".json",
    "NUL": "manifests/000000000004-0123456789ab.json\x00.json",
    "non-UTF-8": "manifests/\udcff\udcfe.json",
    "number": -(10**15),
    "list": ["../../outside/precious.json"],
}


def _payload(value: Any, root: Path) -> Any:
    return value.replace("{ROOT}", str(root)) if isinstance(value, str) else value


# ---------------------------------------------------------------------------- the commands


def _snapshot(root: Path, skip: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """Every file and link under ``root`` except the allowed places: path -> (kind, content hash)."""
    out: dict[str, tuple[str, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        if any(rel_dir == s or rel_dir.startswith(s + os.sep) for s in skip):
            dirnames[:] = []
            continue
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if any(rel == s or rel.startswith(s + os.sep) for s in skip):
                continue
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            else:
                with open(path, "rb") as f:
                    out[rel] = ("file", hashlib.sha256(f.read()).hexdigest())
    return out


ALLOWED = (STORE, REMOTE, "empty", "out.pt")
CLI_CODES = {0, 1, 2}


def _cli(args: list[str]) -> tuple[int, str]:
    """One command in this process, its errors mapped as ``smartckpt``'s main() maps them."""
    result = runner.invoke(app, args)
    out = result.output
    exc = result.exception
    if exc is None or isinstance(exc, SystemExit):
        code = result.exit_code
    elif isinstance(exc, SmartckptError):
        code = exc.exit_code
        out += f"smartckpt: error: {exc}"
    elif isinstance(exc, OSError):
        code = 2 if isinstance(exc, FileNotFoundError | PermissionError) else 1
    else:
        import traceback

        tb = "".join(traceback.format_exception(exc))
        raise AssertionError(f"smartckpt {' '.join(args[:2])} raised {type(exc).__name__}:\n{tb}")
    assert "Traceback" not in out, out
    assert code in CLI_CODES, (args, code, out)
    return code, out


def _restore(store: Path, **settings: Any) -> int | str:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    try:
        mgr = CheckpointManager(store, keep_last=10, **settings)
    except SmartckptError as err:
        return f"refused: {err}"
    try:
        mgr.register(model=model, optimizer=opt)
        return mgr.restore()
    except SmartckptError as err:
        return f"refused: {err}"
    finally:
        mgr.close()


def run_every_command(root: Path) -> dict[str, Any]:
    store, remote = str(root / STORE), f"file://{root / REMOTE}"
    got: dict[str, Any] = {}
    rng = torch.get_rng_state()
    try:
        got["verify"] = _cli(["verify", store, "--all", "--no-record"])
        got["inspect"] = _cli(["inspect", store, "--json"])
        got["inspect table"] = _cli(["inspect", store])
        got["plot"] = _cli(["plot", store, "--json"])
        got["export"] = _cli(["export", store, str(root / "out.pt"), "--force"])
        got["rollback"] = _cli(["rollback", store, "--to-prev"])
        got["verify remote"] = _cli(["verify", store, "--remote", remote, "--all", "--no-record"])
        got["restore"] = _restore(root / STORE)
        got["restore from remote"] = _restore(root / "empty", remote=remote, remote_close_wait=5)
        got["prune remote"] = _cli(["prune", store, "--keep", "1", "--remote", remote])
        got["prune"] = _cli(["prune", store, "--keep", "1"])
    finally:
        torch.set_rng_state(rng)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("payload", list(PAYLOADS), ids=list(PAYLOADS))
@pytest.mark.parametrize("field", list(FIELDS), ids=list(FIELDS))
def test_nothing_outside_is_touched(case: Path, field: str, payload: str) -> None:
    before = _snapshot(case, ALLOWED)
    FIELDS[field](case, _payload(PAYLOADS[payload], case))
    planted = _snapshot(case, ALLOWED)  # an attack may plant a file outside (a remote object's target)
    assert set(planted) >= set(before)
    got = run_every_command(case)
    after = _snapshot(case, ALLOWED)
    assert after == planted, f"files outside changed: {sorted(set(after) ^ set(planted))} / {got}"
    assert (case / CANARY).read_text() == '{"precious": true}'


# ---------------------------------------------------------------------------- symlinks


def _symlink(target_rel: str, link_rel: str) -> Callable[[Path], None]:
    def plant(root: Path) -> None:
        link = root / STORE / link_rel
        target = root / target_rel
        if link.is_dir() and not link.is_symlink():
            shutil.copytree(link, target, dirs_exist_ok=True)  # what was there now lies outside
            shutil.rmtree(link)
        elif link.exists():
            shutil.copy(link, target) if not target.exists() else None
            link.unlink()
        link.symlink_to(target)

    return plant


def _blob_file(root: Path) -> str:
    fan = sorted((root / STORE / "blobs").iterdir())[0]
    return f"blobs/{fan.name}/{sorted(fan.iterdir())[0].name}"


SYMLINKS: dict[str, Callable[[Path], None]] = {
    "blobs/ points outside": _symlink("outside/dir/blobs", "blobs"),
    "manifests/ points outside": _symlink("outside/dir/manifests", "manifests"),
    "a fan-out folder points outside": lambda root: _symlink(
        "outside/dir/fan", _blob_file(root).rsplit("/", 1)[0]
    )(root),
    "a blob file points outside": lambda root: _symlink("outside/dir/keep.bin", _blob_file(root))(root),
    "a stray manifest points outside": lambda root: (
        root / STORE / "manifests" / "000000000099-0123456789ab.json"
    ).symlink_to(root / CANARY),
}


@pytest.mark.slow
@pytest.mark.parametrize("what", list(SYMLINKS))
def test_symlinks_out_of_the_store_are_never_written_nor_removed_through(case: Path, what: str) -> None:
    SYMLINKS[what](case)
    planted = _snapshot(case, ALLOWED)
    outside = {k: v for k, v in planted.items() if k.startswith("outside")}
    got = run_every_command(case)
    after = _snapshot(case, ALLOWED)
    assert {k: v for k, v in after.items() if k.startswith("outside")} == outside, got
    if "folder" in what or "/ points" in what:
        # writing or removing through it is refused in one line; read-only commands say what they found
        assert got["prune"][0] == 1 and "symlink" in got["prune"][1], got["prune"]
        assert got["verify"][0] == 1 and "symlink" in got["verify"][1], got["verify"]
        assert isinstance(got["restore"], str) and "symlink" in got["restore"], got["restore"]


# ---------------------------------------------------------------------------- the three cases, for real


def _smartckpt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from smartckpt_cli.cli.app import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.parametrize("payload", ["absolute", "dotdot", "in then out"])
def test_prune_with_a_journal_line_naming_a_file_outside(case: Path, payload: str) -> None:
    journal_field("manifest", 0)(case, _payload(PAYLOADS[payload], case))
    before = _snapshot(case, (STORE, REMOTE))
    done = _smartckpt("prune", str(case / STORE), "--keep", "1")
    assert done.returncode == 1, done
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("smartckpt: error:"), done.stderr
    assert (
        "journal.jsonl line" in done.stderr
        and "manifest" in done.stderr
        and "outside/precious.json" in done.stderr
    )
    assert "Traceback" not in done.stdout + done.stderr
    assert _snapshot(case, (STORE, REMOTE)) == before
    assert (case / CANARY).read_text() == '{"precious": true}'
    # verify names the damaged checkpoint (CORRUPT) and exits 1
    checked = _smartckpt("verify", str(case / STORE), "--all", "--no-record")
    assert (
        checked.returncode == 1 and "CORRUPT" in checked.stdout and "outside/precious.json" in checked.stdout
    )


def test_restore_onto_a_wiped_node_with_a_remote_commit_naming_a_file_outside(case: Path) -> None:
    # The remote's newest commit names ../../outside/m.json, and that object exists on the remote.
    remote_field("manifest")(case, "../../outside/m.json")
    planted_target = case / "bucket" / "outside" / "m.json"
    assert planted_target.exists()
    before = _snapshot(case, (REMOTE, "empty"))
    got = _restore(case / "empty", remote=f"file://{case / REMOTE}", remote_close_wait=5)
    assert got == 3, got  # the previous remote checkpoint, after the damaged newest one
    assert _snapshot(case, (REMOTE, "empty")) == before
    assert (case / "outside" / "m.json").read_text() == '{"also": "precious"}'
    # the damaged commit is named in one line by verify --remote
    done = _smartckpt("verify", str(case / STORE), "--remote", f"file://{case / REMOTE}", "--no-record")
    assert done.returncode == 1 and "manifest" in done.stdout + done.stderr
