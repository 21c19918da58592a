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
