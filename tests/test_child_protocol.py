"""The child-to-supervisor report is one list (``FACTS`` in hooks/_smartckpt_protocol.py):
every fact this package reports is on it, a name that is not is never written, each fact the run
record keeps (use KEPT or START) has its field in the attempt record and reaches it, and only the
owning modules read a fact by its name (childreport.py, and records.py that declares the fields):
the rest of the supervisor and the CLI go through them."""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
from pathlib import Path

import pytest
from smartckpt_cli.hooks import _smartckpt_protocol as proto

import smartckpt_cli
from smartckpt_cli.engine import report as report_mod
from smartckpt_cli.supervise.childreport import learn, restart_phases
from smartckpt_cli.supervise.records import AttemptRecord, RunRecord

PACKAGE = Path(smartckpt_cli.__file__).parent


def _reported_names() -> dict[str, list[str]]:
    """Every keyword passed to ``report(...)`` or ``note(...)`` of engine/report.py in the
    package, with where."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        imported = {
            a.asname or a.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("engine.report")
            for a in node.names
        }
        if path.name == "report.py" and path.parent.name == "engine":
            imported |= {"report", "note"}
        if path.name == "resumecheck.py":  # handed engine/report.py's report as ``tell`` (stepping.py)
            imported.add("tell")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
                for kw in node.keywords:
                    if kw.arg is not None:
                        found.setdefault(kw.arg, []).append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def test_every_fact_the_package_reports_is_in_the_protocol():
    found = _reported_names()
    assert {"start_step", "resume_check", "io_error", "torch_ready"} <= found.keys()  # the scan sees them
    unknown = {k: v for k, v in found.items() if k not in proto.REPORT_FACTS}
    assert not unknown, f"reported but not in REPORT_FACTS: {unknown}"


RECORDED = proto.of_use(proto.KEPT) + proto.of_use(proto.START)  # the record's fields of their names
USED = [name for name, fact in proto.FACTS.items() if fact.use]  # what the supervisor reads
OWNERS = {"supervise/childreport.py", "supervise/records.py"}
# Another object's attribute of the same name: ``smartckpt inspect``'s catalog (from the journal).
NOT_THE_RECORD = {("cli/inspect_cmd.py", "checkpointing_off")}


def test_every_kept_fact_has_its_field_in_the_attempt_record():
    fields = {f.name: f for f in dataclasses.fields(AttemptRecord)}
    assert set(proto.KEPT_FACTS) <= set(RECORDED) and {"start_step", "resume_check"} <= set(RECORDED)
    missing = [name for name in RECORDED if name not in fields]
    assert not missing, f"kept in the run record but no AttemptRecord field: {missing}"
    for name, fact in proto.FACTS.items():  # the declarations hold together
        assert fact.use in ("", proto.KEPT, proto.START, proto.CAUSE, proto.PHASE), name
        assert all(since in proto.of_use(proto.PHASE) for _, since in fact.phases if since), name
        assert fact.use != proto.CAUSE or (fact.why and fact.fix), name


def _readers(names: set[str], *, owners: set[str]) -> list[str]:
    """Where the supervisor or the CLI, outside ``owners``, reads one of ``names`` by name: an
    attribute of that name (not ``self.``'s own) or the name as a string (``report.get("x")``,
    ``getattr(att, "x")``)."""
    found = []
    for path in sorted([*(PACKAGE / "supervise").glob("*.py"), *(PACKAGE / "cli").glob("*.py")]):
        rel = str(path.relative_to(PACKAGE))
        if rel in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Attribute) and node.attr in names:
                own = isinstance(node.value, ast.Name) and node.value.id == "self"
                if not own and (rel, node.attr) not in NOT_THE_RECORD:
                    found.append(f"{rel}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{rel}:{node.lineno} {node.value!r}")
    return found


def test_a_fact_is_read_by_name_only_in_its_owning_module():
    names = set(RECORDED) | set(USED)
    # the scan sees the owners' reads, so it would see anyone else's
    assert any("childreport.py" in where for where in _readers(names, owners=set()))
    readers = _readers(names, owners=OWNERS)
    assert not readers, f"read by name outside {sorted(OWNERS)} (use childreport.py's functions): {readers}"


def test_the_cli_knows_no_field_of_the_run_record():
    fields = {f.name for f in dataclasses.fields(RunRecord)} | {"restarts", "path", "to_json"}
    found = []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("supervise.records"):
                found += [f"{path.name}: imports {a.name}" for a in node.names if a.name.endswith("Record")]
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "record"
                and node.attr in fields
            ):
                found.append(f"{path.name}:{node.lineno} .record.{node.attr}")
    assert not found, f"the CLI reads the run record (supervise/summary.py words it): {found}"


def test_restart_phases_follow_the_declarations():
    marks = {"restore_began": 102.0, "restore_done": 102.5}
    assert restart_phases(100.0, {"torch_ready": 99.0, **marks}) == {
        "imports": 0.0,
        "to_restore": 2.0,
        "restore": 0.5,
    }
    assert "imports" not in (restart_phases(100.0, {"torch_ready": 103.0, **marks}) or {})  # out of order
    assert restart_phases(100.0, {"restore_began": True, "restore_done": 102.5}) is None  # not a wall time


@pytest.mark.parametrize("name", sorted(proto.KEPT_FACTS))
def test_a_kept_fact_reaches_the_record_once_and_a_wrong_type_never(name):
    kind = proto.KEPT_FACTS[name]
    value = True if kind is bool else {"step": 7, "why": "x", "count": 1, "what": "trace", "error": "e"}
    att = AttemptRecord(0, 1, 0.0)
    assert learn(att, {name: "not a " + kind.__name__}, "t.py") == []
    assert not getattr(att, name)
    assert learn(att, {name: value}, "t.py") == [name]
    assert getattr(att, name) == value
    assert learn(att, {name: value}, "t.py") == []  # said once


def test_a_name_outside_the_protocol_is_not_written(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SMARTCKPT_RUN_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        report_mod.report(start_step=3, made_up_fact=1)
    written = json.loads(next(tmp_path.glob("report.*.json")).read_text())
    assert written["start_step"] == 3 and "made_up_fact" not in written
    assert "made_up_fact" in caplog.text and "not in the report protocol" in caplog.text
