"""The child-to-supervisor report is one list (``REPORT_FACTS`` in hooks/_smartckpt_protocol.py):
every fact this package reports is on it, a name that is not is never written, and each fact the
run record keeps (``KEPT_FACTS``) has its field in the attempt record and reaches it."""

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
from smartckpt_cli.supervise.childreport import learn
from smartckpt_cli.supervise.records import AttemptRecord

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


def test_every_kept_fact_has_its_field_in_the_attempt_record():
    fields = {f.name: f for f in dataclasses.fields(AttemptRecord)}
    for name in proto.KEPT_FACTS:
        assert name in proto.REPORT_FACTS and name in fields, name


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
