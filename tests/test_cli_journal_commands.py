"""The journal commands through typer's CliRunner: inspect/ls, verify, prune, rollback, config show.

Each test works on its own copy of one real store written by the deterministic demo training
(steps 5..30, a checkpoint every 5 steps, keep_last 3 by default, so 5..15 are already pruned).
Real subprocesses, a concurrent training run and the bad-input list are in test_cli_processes.py
and test_bad_input.py; export in test_cli_export.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from smartckpt_cli.cli.app import app
from smartckpt_cli.store.directory import open_store
from smartckpt_cli.store.journal import encode_line

runner = CliRunner()


@pytest.fixture
def store(store_copy: Path) -> Path:
    """A writable copy of the demo store (conftest.py): six checkpoints, steps 5..30."""
    return store_copy


def _json(args: list[str]) -> dict:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _steps(store: Path, state: str = "live") -> list[int]:
    rows = _json(["inspect", str(store), "--json"])["checkpoints"]
    return [r["step"] for r in rows if r["state"] == state]


def _manifest(store: Path, step: int) -> dict:
    rec = next(r for r in open_store(store).journal.read().records if r.step == step and not r.pruned)
    return json.loads((store / rec.manifest).read_text())


def _blob(store: Path, bid: str) -> Path:
    return store / "blobs" / bid[:2] / bid


# ---------------------------------------------------------------------------- inspect


def test_inspect_lists_newest_first_with_sizes_and_marks(store: Path) -> None:
    rows = _json(["inspect", str(store), "--json"])["checkpoints"]
    assert [r["step"] for r in rows] == [30, 25, 20, 15, 10, 5]
    assert all(r["state"] == "live" for r in rows)
    assert [r["restore_target"] for r in rows] == [True] + [False] * 5
    first = rows[0]
    assert first["tiers"] == ["L1", "L2", "L3"] and first["precision"] == "exact"
    assert first["reason"] == "every 5 steps" and first["health"] == "ok"
    assert first["utc"].endswith("Z") and first["verified"] == "never"
    # unique + shared = total; something is shared (the data loader's generator state, ...)
    for r in rows:
        assert r["bytes_unique"] + r["bytes_shared"] == r["bytes_total"] > 0
    assert sum(r["bytes_shared"] for r in rows) > 0
    # the unique bytes are exactly what the checkpoint's blobs take on disk beyond the others
    m30 = _manifest(store, 30)
    others = set()
    for s in (25, 20, 15, 10, 5):
        for e in _manifest(store, s)["entries"].values():
            others |= {c[0] for c in e["data"]["chunks"]}
    mine = {c[0] for e in m30["entries"].values() for c in e["data"]["chunks"]}
    assert first["bytes_unique"] == sum(_blob(store, b).stat().st_size for b in mine - others)


def test_inspect_table_and_ls_alias(store: Path) -> None:
    a = runner.invoke(app, ["inspect", str(store)])
    b = runner.invoke(app, ["ls", str(store)])
    assert a.exit_code == b.exit_code == 0
    assert a.stdout == b.stdout
    lines = [ln for ln in a.stdout.splitlines() if "every 5 steps" in ln]
    assert len(lines) == 6 and lines[0].split("│")[1].strip() == ">"
    assert "L1+L2+L3" in lines[0] and "KiB" in lines[0] and "live" in lines[0]


def test_inspect_step_shows_the_manifest_tensor_by_tensor(store: Path) -> None:
    detail = _json(["inspect", str(store), "--step", "20", "--json"])
    keys = {e["key"]: e for e in detail["entries"]}
    assert keys["model/0.weight"]["shape"] == [128, 32] and keys["model/0.weight"]["tier"] == "L1"
    assert keys["model/0.weight"]["bytes_raw"] == 128 * 32 * 4
    assert any(k.startswith("optimizer/state/") and e["tier"] == "L2" for k, e in keys.items())
    assert detail["objects"] == {
        "rng": "rng",
        "model": "module",
        "optimizer": "optimizer",
        "scheduler": "state",
        "data": "data",
    }
    assert detail["checkpoint"]["step"] == 20
    table = runner.invoke(app, ["ls", str(store), "--step", "20"])
    assert table.exit_code == 0 and "model/0.weight" in table.stdout and "128x32" in table.stdout


def test_inspect_step_that_does_not_exist(store: Path) -> None:
    result = runner.invoke(app, ["inspect", str(store), "--step", "7"])
    assert result.exit_code != 0
    assert "no checkpoint of step 7" in str(result.exception)


# ---------------------------------------------------------------------------- verify


def test_verify_default_all_and_step(store: Path) -> None:
    out = runner.invoke(app, ["verify", str(store)])
    assert out.exit_code == 0 and out.stdout.splitlines() == [out.stdout.splitlines()[0]]
    assert out.stdout.startswith("step 30 (") and out.stdout.rstrip().endswith(": ok")
    full = _json(["verify", str(store), "--all", "--json"])
    assert full["ok"] and [r["step"] for r in full["results"]] == [30, 25, 20, 15, 10, 5]
    assert full["bytes_checked"] > 0
    one = _json(["verify", str(store), "--step", "15", "--json"])
    assert [r["step"] for r in one["results"]] == [15]
    # recorded, so inspect shows it
    rows = {r["step"]: r for r in _json(["inspect", str(store), "--json"])["checkpoints"]}
    assert rows[15]["verified"] == "ok" and rows[15]["verified_utc"]


def test_verify_names_each_corrupt_checkpoint_and_the_fault(store: Path) -> None:
    m25, m20 = _manifest(store, 25), _manifest(store, 20)
    shared = {c[0] for e in m20["entries"].values() for c in e["data"]["chunks"]}
    w25 = next(c[0] for c in m25["entries"]["model/0.weight"]["data"]["chunks"] if c[0] not in shared)
    w20 = m20["entries"]["model/0.weight"]["data"]["chunks"][0][0]
    _blob(store, w25).unlink()  # missing blob
    path = _blob(store, w20)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # hash mismatch
    path.write_bytes(bytes(data))
    result = runner.invoke(app, ["verify", str(store), "--all", "--no-record"])
    assert result.exit_code == 1
    lines = {ln.split(" (")[0]: ln for ln in result.stdout.splitlines()}
    assert lines["step 30"].endswith(": ok")
    assert f"CORRUPT: L1 entry model/0.weight: missing blob {w25}" in lines["step 25"]
    assert f"CORRUPT: L1 entry model/0.weight: hash mismatch in blob {w20}" in lines["step 20"]
    assert lines["step 15"].endswith(": ok")


def test_verify_undecodable_chunk(store: Path) -> None:
    """A blob whose name matches its bytes but which does not decode: a bad frame written
    under its own hash (what a buggy or foreign writer could leave)."""
    from smartckpt_cli.store import codec

    m30 = _manifest(store, 30)
    key = "model/0.weight"
    entry = m30["entries"][key]
    bad = b"\x01" + b"garbage that is not a planes frame" * 10
    bid = codec.blob_id(bad)
    _blob(store, bid).parent.mkdir(parents=True, exist_ok=True)
    _blob(store, bid).write_bytes(bad)
    chunk = entry["data"]["chunks"][0]
    entry["data"]["chunks"][0] = [bid, "planes", chunk[2], chunk[3], len(bad)]
    _rewrite_manifest(store, 30, m30)
    result = runner.invoke(app, ["verify", str(store), "--no-record"])
    assert result.exit_code == 1
    assert f"CORRUPT: L1 entry {key}: undecodable chunk {bid}" in result.stdout


def _rewrite_manifest(store: Path, step: int, manifest: dict) -> None:
    """Replace a manifest and re-commit it (a new commit line with the new hash), so only the
    chunk check can find the fault."""
    from smartckpt_cli.store import codec
    from smartckpt_cli.store.journal import encode_manifest

    st = open_store(store)
    rec = next(r for r in st.journal.read().records if r.step == step and not r.pruned)
    data = encode_manifest(manifest)
    (store / rec.manifest).write_bytes(data)
    lines = (store / "journal.jsonl").read_bytes().splitlines(keepends=True)
    ev = {**rec.event, "manifest_hash": codec.blob_id(data)}
    lines[rec.position] = encode_line(ev)
    (store / "journal.jsonl").write_bytes(b"".join(lines))


def test_verify_torn_journal_line_exits_1(store: Path) -> None:
    line = encode_line({"event": "commit", "step": 35, "id": "x" * 12, "manifest": "m", "manifest_hash": "0"})
    with open(store / "journal.jsonl", "ab") as f:
        f.write(line[: len(line) // 2])
    before = (store / "journal.jsonl").read_bytes()
    result = runner.invoke(app, ["verify", str(store)])
    assert result.exit_code == 1
    assert "journal:" in result.stdout and "torn last line" in result.stdout
    assert (store / "journal.jsonl").read_bytes() == before, "verify must not repair or record"


def test_verify_step_and_all_exclude_each_other(store: Path) -> None:
    result = runner.invoke(app, ["verify", str(store), "--all", "--step", "30"])
    assert result.exit_code != 0 and "exclude each other" in str(result.exception)


# ---------------------------------------------------------------------------- prune


def test_prune_dry_run_removes_nothing(store: Path) -> None:
    before = sorted(p.relative_to(store) for p in store.rglob("*") if p.is_file())
    result = runner.invoke(app, ["prune", str(store), "--keep", "2", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "would remove step 20" in result.stdout and "would remove step 5" in result.stdout
    after = sorted(p.relative_to(store) for p in store.rglob("*") if p.is_file())
    assert [p for p in before if p.name != "journal.lock"] == [p for p in after if p.name != "journal.lock"]
    assert _steps(store) == [30, 25, 20, 15, 10, 5]


def test_prune_keeps_newest_removes_blobs_and_records_it(store: Path) -> None:
    out = _json(["prune", str(store), "--keep", "2", "--json"])
    assert [r["step"] for r in out["kept"]] == [30, 25]
    assert [r["step"] for r in out["removed"]] == [20, 15, 10, 5]
    assert out["bytes_freed"] > 0 and out["newest_verified"]["step"] == 30
    assert _steps(store) == [30, 25] and _steps(store, "pruned") == [20, 15, 10, 5]
    events = [json.loads(ln) for ln in (store / "journal.jsonl").read_text().splitlines()]
    prunes = [e for e in events if e["event"] == "prune"]
    assert prunes[-1]["steps"] == [20, 15, 10, 5] and "smartckpt prune" in prunes[-1]["why"]
    referenced = set()
    for s in (30, 25):
        for e in _manifest(store, s)["entries"].values():
            referenced |= {c[0] for c in e["data"]["chunks"]}
            referenced |= {c[0] for c in (e.get("patch") or {}).get("chunks", [])}
    on_disk = {p.name for p in (store / "blobs").rglob("*") if p.is_file()}
    assert on_disk == referenced
    assert len(list((store / "manifests").iterdir())) == 2
    assert runner.invoke(app, ["verify", str(store), "--all"]).exit_code == 0


def test_prune_never_removes_the_newest_verified_checkpoint(store: Path) -> None:
    """The two newest are corrupt: --keep 1 keeps step 30 (newest) and step 20 (newest that
    verifies), whatever --keep says."""
    for s in (30, 25):
        m = _manifest(store, s)
        bid = m["entries"]["model/0.weight"]["data"]["chunks"][0][0]
        p = _blob(store, bid)
        p.write_bytes(p.read_bytes()[:-10])  # truncated
    out = _json(["prune", str(store), "--keep", "1", "--json"])
    assert [r["step"] for r in out["kept"]] == [30, 20]
    assert out["newest_verified"]["step"] == 20
    assert len(out["passed_over"]) == 2 and "hash mismatch" in out["passed_over"][0]
    assert _steps(store) == [30, 20]


def test_prune_refuses_when_nothing_verifies(store: Path) -> None:
    for s in (30, 25, 20, 15, 10, 5):
        for e in _manifest(store, s)["entries"].values():
            for c in e["data"]["chunks"]:
                _blob(store, c[0]).unlink(missing_ok=True)
    manifests = sorted(p.name for p in (store / "manifests").iterdir())
    result = runner.invoke(app, ["prune", str(store), "--keep", "1"])
    assert result.exit_code != 0 and "no checkpoint verifies" in str(result.exception)
    assert sorted(p.name for p in (store / "manifests").iterdir()) == manifests


def test_prune_keep_must_be_positive(store: Path) -> None:
    result = runner.invoke(app, ["prune", str(store), "--keep", "0"])
    assert result.exit_code != 0 and "--keep must be at least 1" in str(result.exception)


# ---------------------------------------------------------------------------- rollback


def test_rollback_to_prev_to_step_and_undo(store: Path) -> None:
    r = runner.invoke(app, ["rollback", str(store), "--to-prev"])
    assert r.exit_code == 0, r.output
    assert "rolled back to step 25" in r.stdout
    assert _steps(store) == [25, 20, 15, 10, 5] and _steps(store, "rolled back") == [30]
    r = runner.invoke(app, ["rollback", str(store), "--to", "15"])
    assert r.exit_code == 0 and "rolled back: steps 25, 20" in r.stdout
    assert _steps(store) == [15, 10, 5]
    rows = _json(["inspect", str(store), "--json"])["checkpoints"]
    assert next(x for x in rows if x["restore_target"])["step"] == 15
    table = runner.invoke(app, ["inspect", str(store)]).stdout
    assert table.count("rolled back") == 3
    r = runner.invoke(app, ["rollback", str(store), "--undo"])
    assert r.exit_code == 0 and "live again: steps 25, 20" in r.stdout
    assert _steps(store) == [25, 20, 15, 10, 5]
    assert runner.invoke(app, ["rollback", str(store), "--undo"]).exit_code == 0
    assert _steps(store) == [30, 25, 20, 15, 10, 5]
    r = runner.invoke(app, ["rollback", str(store), "--undo"])
    assert r.exit_code != 0 and "no rollback to undo" in str(r.exception)


def test_rollback_is_what_the_next_resume_loads(store: Path) -> None:
    from smartckpt_cli import CheckpointManager
    from smartckpt_cli.ops.demo_train import build

    assert runner.invoke(app, ["rollback", str(store), "--to", "20"]).exit_code == 0
    model, opt, sched, loader = build()
    with CheckpointManager(store, create=False) as mgr:
        mgr.register(model=model, optimizer=opt, scheduler=sched, data=loader)
        assert mgr.restore() == 20


def test_rollback_refuses_a_corrupt_target(store: Path) -> None:
    m = _manifest(store, 20)
    bid = m["entries"]["model/0.weight"]["data"]["chunks"][0][0]
    _blob(store, bid).write_bytes(b"rot")
    journal = (store / "journal.jsonl").read_bytes()
    r = runner.invoke(app, ["rollback", str(store), "--to", "20"])
    assert r.exit_code != 0 and "does not verify" in str(r.exception)
    assert (store / "journal.jsonl").read_bytes() == journal


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--to", "7"], "no checkpoint of step 7"),
        (["--to", "30"], "already what a resume loads"),
        (["--to", "1", "--undo"], "exactly one of"),
        ([], "exactly one of"),
    ],
)
def test_rollback_bad_arguments(store: Path, args: list[str], words: str) -> None:
    journal = (store / "journal.jsonl").read_bytes()
    r = runner.invoke(app, ["rollback", str(store), *args])
    assert r.exit_code != 0 and words in str(r.exception)
    assert (store / "journal.jsonl").read_bytes() == journal


# ---------------------------------------------------------------------------- config show


def test_config_show_sources_and_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("SMARTCKPT_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smartckpt.yaml").write_text("keep_last: 4\nprecision: bf16\nchunk_mb: 8\n")
    monkeypatch.setenv("SMARTCKPT_PRECISION", "fp16")
    monkeypatch.setenv("SMARTCKPT_CHUNK_MB", "2")
    out = _json(["config", "show", "--set", "chunk_mb=1", "--json"])
    s = out["settings"]
    assert out["file"] == "smartckpt.yaml"
    assert s["keep_last"] == {"value": 4, "source": "smartckpt.yaml"}
    assert s["precision"] == {"value": "fp16", "source": "env SMARTCKPT_PRECISION"}
    assert s["chunk_mb"] == {"value": 1, "source": "flag"}
    assert s["max_interval"] == {"value": 180.0, "source": "default"}
    table = runner.invoke(app, ["config", "show"]).stdout
    assert "env SMARTCKPT_PRECISION" in table and "keep_last" in table


def test_config_show_and_run_records_never_hold_remote_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from smartckpt_cli.config import load_settings, public_settings

    for name in [n for n in os.environ if n.startswith("SMARTCKPT_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SMARTCKPT_REMOTE", "s3://AKIA:verysecret@bucket/run?token=tok3n&region=eu")
    shown = _json(["config", "show", "--json"])["settings"]["remote"]["value"]
    recorded = public_settings(load_settings(None)[0])  # what a run record keeps
    assert shown == recorded["remote"] and shown.startswith("s3://bucket/run"), shown
    assert "region=eu" in shown
    text = json.dumps(recorded)
    assert "verysecret" not in text and "tok3n" not in text and "AKIA" not in text


@pytest.mark.parametrize(
    ("setup", "args", "words"),
    [
        ({"yaml": "keep_lats: 4\n"}, [], "unknown setting 'keep_lats'"),
        ({"yaml": "keep_last: many\n"}, [], "keep_last must be int"),
        ({"env": ("SMARTCKPT_KEEP_LAST", "x")}, [], "keep_last must be int"),
        ({"env": ("SMARTCKPT_NOPE", "1")}, [], "unknown setting 'nope'"),
        ({}, ["--set", "chunk_mb=big"], "chunk_mb must be int"),
        ({}, ["--set", "colour=red"], "unknown setting 'colour'"),
        ({}, ["--config", "missing.yaml"], "config file missing.yaml does not exist"),
    ],
)
def test_config_errors_name_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setup: dict, args: list[str], words: str
) -> None:
    for name in [n for n in os.environ if n.startswith("SMARTCKPT_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    if "yaml" in setup:
        (tmp_path / "smartckpt.yaml").write_text(setup["yaml"])
    if "env" in setup:
        monkeypatch.setenv(*setup["env"])
    result = runner.invoke(app, ["config", "show", *args])
    assert result.exit_code != 0
    assert words in str(result.exception)
    assert getattr(result.exception, "exit_code", None) == 2


# ---------------------------------------------------------------------------- help


@pytest.mark.parametrize(
    "command",
    [
        ["inspect"],
        ["ls"],
        ["verify"],
        ["prune"],
        ["rollback"],
        ["export"],
        ["config", "show"],
        ["completions"],
    ],
)
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_has_an_example(command: list[str], flag: str) -> None:
    result = runner.invoke(app, [*command, flag])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "Example" in text and f"smartckpt {command[0] if command[0] != 'ls' else ''}".strip() in text


_EVERY_COMMAND = [
    ["run"],
    ["inspect"],
    ["verify"],
    ["prune"],
    ["rollback"],
    ["export"],
    ["plot"],
    ["simulate"],
    ["bench"],
    ["demo"],
    ["config", "show"],
    ["completions"],
]


@pytest.mark.parametrize("command", _EVERY_COMMAND, ids=lambda c: "-".join(c))
def test_help_fits_80_columns_and_wraps_whole_paragraphs(command: list[str]) -> None:
    """At 80 columns no line of the help is longer than the terminal (an example or an exit
    code line cut in two reads wrong), and a prose paragraph wraps as one: only its last line
    is short (the docstring's own line breaks would cut it twice per line)."""
    import itertools
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    code = "from smartckpt_cli.cli.app import main; main()"
    proc = subprocess.run(
        [sys.executable, "-c", code, *command, "-h"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [ln for ln in lines if len(ln) > 80] == []
    # Prose: indented by one space (rich's margin), not a usage line, not a framed table.
    prose = [
        ln.rstrip() if ln.startswith(" ") and not ln.startswith("  ") and ln.strip() else "" for ln in lines
    ]
    cut = [a for a, b in itertools.pairwise(prose) if a and b and not a.startswith(" Usage") and len(a) < 55]
    assert cut == [], cut
    # A fixed block's line (examples, exit codes) too long for the terminal comes back at the
    # margin, right under the indented line it was cut from.
    wrapped = [
        b
        for a, b in itertools.pairwise(lines)
        if a.startswith("   ") and a.strip() and b.startswith(" ") and not b.startswith("  ") and b.strip()
    ]
    assert wrapped == [], wrapped


def test_a_store_with_its_journal_elsewhere(tmp_path: Path) -> None:
    import torch

    from smartckpt_cli import CheckpointManager

    blobs, meta = tmp_path / "nvme", tmp_path / "shared"
    model = torch.nn.Linear(8, 8)
    with CheckpointManager(blobs, meta_dir=meta, keep_last=5) as mgr:
        mgr.register(model=model)
        for step in (1, 2, 3):
            mgr.save(step, blocking=True).wait()
    opt = ["--meta-dir", str(meta)]
    assert [r["step"] for r in _json(["inspect", str(blobs), *opt, "--json"])["checkpoints"]] == [3, 2, 1]
    assert _json(["verify", str(blobs), "--all", *opt, "--json"])["ok"]
    assert [r["step"] for r in _json(["prune", str(blobs), "--keep", "1", *opt, "--json"])["removed"]] == [
        2,
        1,
    ]
    assert runner.invoke(app, ["export", str(blobs), str(tmp_path / "m.pt"), *opt]).exit_code == 0
    r = runner.invoke(app, ["inspect", str(blobs)])
    assert r.exit_code != 0 and "not a smartckpt checkpoint store" in str(r.exception)
