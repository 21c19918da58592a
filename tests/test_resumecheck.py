"""The resume check (engine/resumecheck.py), lineages (engine/restore.py ``same_lineage``),
``smartckpt_cli.carry`` (agent/carry.py) and what ``smartckpt run`` makes of the child's report
(supervise/childreport.py, cli/run.py), in this process with real managers and real files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import smartckpt_cli as sc
from smartckpt_cli.agent.carry import Carried
from smartckpt_cli.engine.resumecheck import (
    CLOSE_RTOL,
    ResumeCheck,
    expected_of,
    judge,
    not_exact_line,
    tolerance,
)
from smartckpt_cli.errors import NoCheckpointError
from smartckpt_cli.supervise.childreport import learn, predicted_start, script_name, start_line
from smartckpt_cli.supervise.records import AttemptRecord

# ---------------------------------------------------------------- the verdict (pure)


def test_judge_exact_close_differs_and_nothing_to_compare() -> None:
    a = {"loss": 2.25, "grad_norm": 0.5}
    assert judge(a, dict(a)) == "exact"
    near = {"loss": 2.25 * (1 + 1e-6), "grad_norm": 0.5}
    assert judge(a, near) == "differs"  # no tolerance: a bit is a bit
    assert judge(a, near, CLOSE_RTOL) == "close"
    assert judge(a, {"loss": 2.3, "grad_norm": 0.5}, CLOSE_RTOL) == "differs"  # 2 % is not close
    # only the values both sides have count; none in common: no verdict
    assert judge({"loss": 1.0, "grad_norm": None}, {"loss": 1.0, "grad_norm": 3.0}) == "exact"
    assert judge({"loss": None}, {"loss": 1.0}) is None
    # non-finite values, kept in JSON as strings, compare by value
    assert judge({"loss": "nan"}, {"loss": math.nan}) == "exact"
    assert judge({"loss": "inf"}, {"loss": math.inf}, CLOSE_RTOL) == "exact"
    assert judge({"loss": "inf"}, {"loss": 1e30}, CLOSE_RTOL) == "differs"


def test_tolerance_is_zero_where_kernels_are_deterministic() -> None:
    assert tolerance(on_cpu_only=True, deterministic=False) == 0.0
    assert tolerance(on_cpu_only=False, deterministic=True) == 0.0
    assert tolerance(on_cpu_only=False, deterministic=False) == CLOSE_RTOL


def test_not_exact_line_names_the_values_the_causes_and_the_readme_section() -> None:
    check = {
        "step": 76,
        "verdict": "differs",
        "expected": {"loss": 2.1842, "grad_norm": 0.71},
        "got": {"loss": 2.1238, "grad_norm": 0.83},
    }
    line = not_exact_line(check, 0.0)
    assert "\n" not in line and line.startswith("smartckpt: the resume is not exact: step 76")
    assert "loss 2.1238 where the interrupted run had 2.1842" in line and "gradient norm 0.83" in line
    for cause in (
        "a batch fetched before the optimizer step",
        "a hidden state carried across steps",
        "an unseeded RNG",
    ):
        assert cause in line
    assert 'README, section "Your loop"' in line
    close = not_exact_line({**check, "verdict": "close"}, CLOSE_RTOL)
    assert "close, not bit-exact" in close and "0.0001" in close
    # a cause the restore knew (DDP's bucket layout not carried) is named, not the generic list
    known = "DDP 'model': the first step after this resume sums gradients in another order"
    line = not_exact_line({**check, "known": [known]}, 0.0)
    assert f"known cause: {known}" in line and "an unseeded RNG" not in line


def test_expected_values_come_from_the_manifest_else_from_the_journal() -> None:
    manifest = {"meta": {"next_step": {"step": 8, "loss": 1.5, "grad_norm": 2.0}}}
    calls: list[int] = []

    def events() -> list[dict[str, Any]]:
        calls.append(1)
        return [{"event": "step_after", "id": "c1", "step": 8, "loss": 0.5, "grad_norm": None}]

    assert expected_of(manifest, "c1", events) == {"loss": 1.5, "grad_norm": 2.0} and not calls
    assert expected_of({"meta": {}}, "c1", events) == {"loss": 0.5, "grad_norm": None}
    assert expected_of({"meta": {}}, "other", events) is None


def test_the_check_is_armed_for_one_step_only() -> None:
    check = ResumeCheck()
    check.check(11, {"id": "c", "step": 10, "expected": {"loss": 1.0}, "rtol": 0.0})
    check.expect(11, "handle")  # a save right after the restore: both at the same step
    assert check.take(10, torch.tensor(1.0), None) is None and check.step == 11
    values, saved, restored = check.take(11, torch.tensor(2.0), torch.tensor(4.0)) or (None, None, None)
    assert values is not None and values.read()["loss"] == 0.5  # divided by the loss scale
    assert saved == "handle" and restored is not None and restored["id"] == "c"
    assert check.step == -1 and check.take(11, 1.0, None) is None
    check.expect(21, "h")
    assert check.take(22, 1.0, None) is None and check.step == -1  # step 21 was missed: disarmed


# ---------------------------------------------------------------- with a real manager


def _train(model: torch.nn.Module, opt: Any, mgr: Any, steps: range, data_seed: int = 0) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(data_seed * 1000 + step)
        x = torch.randn(8, 4, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mgr.step(step + 1, loss=loss)
        losses.append(float(loss.detach()))
    return losses


def _journal(store: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (store / "journal.jsonl").read_text().splitlines()]


def _build() -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.usefixtures("isolated")
def test_manager_records_the_step_after_a_save_and_checks_the_resume(tmp_path: Path) -> None:
    store = tmp_path / "ckpt"
    model, opt = _build()
    with sc.CheckpointManager(store, every_steps=5) as mgr:
        mgr.register(model=model, optimizer=opt)
        _train(model, opt, mgr, range(0, 7))
    commit5 = next(e for e in _journal(store) if e["event"] == "commit" and e["step"] == 5)
    # step 6's values: in checkpoint 5's manifest when they came before it was written, else in
    # the journal after its commit; one of the two, never both
    manifest = json.loads((store / commit5["manifest"]).read_text())
    after = [e for e in _journal(store) if e["event"] == "step_after"]
    assert bool(manifest["meta"].get("next_step")) != bool(after)
    expected = expected_of(manifest, commit5["id"], lambda: _journal(store))
    assert expected is not None and isinstance(expected["loss"], float) and expected["grad_norm"] > 0
    assert not after or [(e["id"], e["step"]) for e in after] == [(commit5["id"], 6)]

    # A restore with no step after it checks nothing.
    model2, opt2 = _build()
    with sc.CheckpointManager(store, every_steps=5) as mgr:
        mgr.register(model=model2, optimizer=opt2)
        assert mgr.restore() == 5
    assert not [e for e in _journal(store) if e["event"] == "resume_check"]
    # The same loop resumed: step 6 computes what it computed before.
    model3, opt3 = _build()
    with sc.CheckpointManager(store, every_steps=5) as mgr:
        mgr.register(model=model3, optimizer=opt3)
        assert mgr.restore() == 5
        _train(model3, opt3, mgr, range(5, 7))
    model4, opt4 = _build()
    with sc.CheckpointManager(store, every_steps=5) as mgr:  # ... and one that does not
        mgr.register(model=model4, optimizer=opt4)
        assert mgr.restore() == 5
        _train(model4, opt4, mgr, range(5, 7), data_seed=1)  # other data after the restore
    checks = [e for e in _journal(store) if e["event"] == "resume_check"]
    assert [(c["step"], c["verdict"], c["id"]) for c in checks] == [
        (6, "exact", commit5["id"]),
        (6, "differs", commit5["id"]),
    ]
    assert checks[0]["got"] == checks[0]["expected"] == expected
    assert checks[1]["got"]["loss"] != checks[1]["expected"]["loss"]


def test_the_step_after_goes_into_the_manifest_until_it_is_written() -> None:
    from types import SimpleNamespace

    from smartckpt_cli.engine.resumecheck import NextStepSlot, capture

    slot = NextStepSlot()
    assert slot.offer(capture(8, torch.tensor(1.5), None, torch.tensor(4.0)))
    snap = SimpleNamespace(meta={"lineage": "x"})
    slot.close(snap)  # the writer, right before the manifest
    assert snap.meta == {"lineage": "x", "next_step": {"step": 8, "loss": 1.5, "grad_norm": 2.0}}
    assert not slot.offer(capture(8, torch.tensor(1.5), None, None))  # too late: the journal's
    late = NextStepSlot()
    late.close(snap := SimpleNamespace(meta={}))
    assert snap.meta == {}  # nothing came: the manifest has no next_step


@pytest.mark.usefixtures("isolated")
def test_a_run_that_began_again_starts_a_lineage_and_restore_never_falls_back_into_the_old_one(
    tmp_path: Path,
) -> None:
    store = tmp_path / "ckpt"
    model, opt = _build()
    with sc.CheckpointManager(store, every_steps=5, keep_last=10) as mgr:
        mgr.register(model=model, optimizer=opt)
        _train(model, opt, mgr, range(0, 15))  # lineage A: 5, 10, 15
        old = mgr.lineage
    model, opt = _build()
    with sc.CheckpointManager(store, every_steps=5, keep_last=10) as mgr:  # restores nothing
        mgr.register(model=model, optimizer=opt)
        _train(model, opt, mgr, range(0, 5))  # lineage B: 5
        new = mgr.lineage
    commits = [e for e in _journal(store) if e["event"] == "commit"]
    assert [(c["step"], c["lineage"]) for c in commits] == [
        (5, old),
        (10, old),
        (15, old),
        (5, new),
    ] and old != new
    from smartckpt_cli.ops.catalog import list_checkpoints
    from smartckpt_cli.store.directory import open_store

    catalog = list_checkpoints(open_store(store))
    assert [(x.line, x.first_step, x.last_step, x.checkpoints) for x in catalog.lineages] == [
        ("A", 5, 15, 3),
        ("B", 5, 5, 1),
    ]
    assert [(r.line, r.step) for r in catalog.rows] == [("B", 5), ("A", 15), ("A", 10), ("A", 5)]
    # B's only checkpoint is damaged: the restore does not take A's step 15 in its place.
    manifest = json.loads((store / commits[-1]["manifest"]).read_text())
    blob = next(iter(manifest["entries"].values()))["data"]["chunks"][0][0]
    path = store / "blobs" / blob[:2] / blob
    path.chmod(0o644)
    path.write_bytes(b"damaged")
    model, opt = _build()
    with sc.CheckpointManager(store) as mgr:
        mgr.register(model=model, optimizer=opt)
        with pytest.raises(
            NoCheckpointError,
            match="3 older checkpoint\\(s\\) \\(newest step 15\\) belong to another lineage",
        ):
            mgr.restore()


# ---------------------------------------------------------------- carry()


def test_carry_outside_smartckpt_run_hands_its_arguments_back() -> None:
    h = torch.ones(2)
    assert sc.carry(hidden=h) is h
    assert sc.carry(a=1, b="x") == (1, "x")
    with pytest.raises(TypeError, match="by name"):
        sc.carry()


def test_carried_values_round_trip_through_their_state_dict() -> None:
    ema = torch.nn.Linear(2, 2)
    box = Carried()
    box.copy_now = lambda: True
    x = torch.arange(4.0)
    box.carry({"batch": (x, x + 1), "best": 0.25, "ema": ema})
    x.add_(100)  # the loop changes its tensor in place after carry(): the copy kept is unchanged
    state = box.state_dict()
    assert torch.equal(state["values"]["batch"][0], torch.arange(4.0)) and state["values"]["best"] == 0.25
    assert set(state["objects"]["ema"]) == {"weight", "bias"}

    again = Carried()
    again.load_state_dict(state)
    fresh = torch.nn.Linear(2, 2)
    out = again.carry({"batch": (torch.zeros(4), torch.zeros(4)), "best": 1e9, "ema": fresh, "new": 3})
    assert torch.equal(out["batch"][1], torch.arange(4.0) + 1) and out["best"] == 0.25
    assert out["ema"] is fresh and torch.equal(fresh.weight, ema.weight)  # loaded in place
    assert out["new"] == 3  # not in the checkpoint: as passed
    assert again.carry({"best": 7.0})["best"] == 7.0  # only the first call after a restore

    stale = Carried()
    stale.stale = True
    final = Carried()
    final.load_state_dict(stale.state_dict())  # a final checkpoint: nothing to hand back
    assert final.carry({"best": 5.0}) == {"best": 5.0}


# ---------------------------------------------------------------- what smartckpt run says


def test_learn_and_say_where_an_attempt_began() -> None:
    assert script_name(["/usr/bin/python3", "-u", "train.py", "--x"]) == "train.py"
    assert script_name(["torchrun", "--nproc_per_node", "2", "a/b/fit.py"]) == "fit.py"
    prev = AttemptRecord(
        0, 1, 0.0, newest_checkpoint=0, start_step=0, max_step=87, restart_from=75, steps_lost=12
    )
    att = AttemptRecord(1, 2, 0.0, newest_checkpoint=75)
    report = {"start_step": 0, "restored_from": None, "start_step_called": False}
    assert learn(att, report, "train.py") == ["start"]
    assert att.start_step == 0 and att.began_again == "train.py does not call smartckpt_cli.start_step()"
    level, line = start_line(att, report, "train.py", prev) or ("", "")
    assert level == "warning" and "began again at step 0, not at the checkpoint of step 75" in line
    assert "it trains 12 step(s) again" in line and "smartckpt_cli.start_step()" in line.split("Fix:")[1]
    assert predicted_start(report, 75) == 0 and predicted_start({"start_step_called": True}, 75) == 75
    assert predicted_start({"start_step_early": True, "start_step_called": True}, 75) == 0
    assert predicted_start(None, 75) == 75
    ok = AttemptRecord(2, 3, 0.0, newest_checkpoint=75)
    assert learn(
        ok,
        {"start_step": 75, "restored_from": "disk", "resume_check": {"step": 76, "verdict": "exact"}},
        "t.py",
    ) == ["start", "resume_check"]
    assert start_line(ok, {}, "t.py", None) == ("info", "attempt 2: resumed at step 75 (restored from disk)")
    assert learn(ok, {"no_optimizer": True}, "t.py") == ["no_optimizer"] and ok.no_optimizer


def test_summary_lines_never_show_a_raw_none() -> None:
    from smartckpt_cli.supervise.summary import attempt_line as _attempt_line

    died = AttemptRecord(0, 1, 0.0, category="no-progress", cause="failed before its first training step")
    assert "None" not in _attempt_line(died, False) and "before its first step" in _attempt_line(died, False)
    lost = AttemptRecord(
        0, 1, 0.0, start_step=0, max_step=9, restart_from=5, category="signal", cause="killed by SIGKILL"
    )
    assert "None" not in (text := _attempt_line(lost, True)) and "an unknown number of steps" in text
    assert "(the next attempt began at step 5)" in text
    # the last attempt of a run that gave up: nothing began after it
    assert "(no attempt followed; a restart would resume at step 5)" in _attempt_line(lost, False)


def test_a_status_line_never_lands_on_a_progress_bar_line(tmp_path: Path) -> None:
    from smartckpt_cli.cli.run import _fresh_line

    log = tmp_path / "log"
    with open(log, "w") as f:
        assert _fresh_line(f) == ""  # empty file
        f.write(" 45%|####      | 45/100\r")
        assert _fresh_line(f) == "\n"
        f.write("\n")
        assert _fresh_line(f) == ""
