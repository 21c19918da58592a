"""One bit-for-bit comparison of two saved training states, shared by the resume tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """``a`` (a resumed run's final state) equals ``b`` (an uninterrupted run's), bit for bit:
    model, optimizer moments and hyperparameters, and whichever of scheduler, scaler and RNG
    state ``b`` holds."""
    for k in b["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"model entry {k} differs"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sb:
        for k in sb[i]:
            assert torch.equal(sa[i][k], sb[i][k]), f"optimizer state {i}/{k} differs"
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    for key in ("scheduler", "scaler"):
        if key in b:
            assert a[key] == b[key], f"{key} state differs"
    assert torch.equal(a["rng"], b["rng"]), "torch RNG state differs at the end"


def resume_checks(store: Path) -> list[dict[str, Any]]:
    """The ``resume_check`` events of a store's journal (engine/resumecheck.py), in order."""
    lines = (Path(store) / "journal.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == "resume_check"]


def expectation(store: Path, step: int) -> dict[str, Any] | None:
    """What the run that saved step ``step`` (the newest commit of it) recorded of the step after
    it, for the resume check: in the checkpoint's manifest, or in the journal; None when the
    run died before it could."""
    events = [json.loads(ln) for ln in (Path(store) / "journal.jsonl").read_text().splitlines()]
    commit = [e for e in events if e.get("event") == "commit" and e.get("step") == step][-1]
    meta = json.loads((Path(store) / commit["manifest"]).read_text()).get("meta", {})
    if meta.get("next_step"):
        return meta["next_step"]
    after = [e for e in events if e.get("event") == "step_after" and e.get("id") == commit["id"]]
    return after[-1] if after else None
