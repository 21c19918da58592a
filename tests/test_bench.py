"""`smartckpt bench` as a user runs it, at a size the suite can afford: every figure measured,
every ratio computed from them, smartckpt's checkpoint restorable and smaller than torch.save's,
and nothing left behind in its work directory. Speed is the bench's job, not this test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from smartckpt_cli.bench import RATIOS

MEASURES = {
    "bound.copy",
    "bound.write+fsync",
    "torch.save+fsync",
    "torch.load+load_state_dict",
    "dcp.save",
    "dcp.async_save.blocking",
    "dcp.async_save.total",
    "smartckpt.blocking",
    "smartckpt.committed",
    "smartckpt.lazy_loop_wait",
    "smartckpt.restore",
    "train_step",
    "train_step_with_lazy_save",
}


def test_bench_measures_every_contender_and_cleans_up(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "bench.json"
    work.mkdir()
    args = ["--params", "3e6", "--reps", "2", "--workdir", str(work), "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "bench", *args],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    res = json.loads(out.read_text())
    assert res["reps"] == 2 and 2.5e6 < res["params"] < 3.5e6
    assert set(res["median_seconds"]) == MEASURES
    for name in MEASURES:
        samples = res["samples"][name]
        assert len(samples) == 2 and all(s > 0 for s in samples), name
    assert set(res["ratios"]) == set(RATIOS)
    med = res["median_seconds"]
    for label, (a, b) in RATIOS.items():
        assert res["ratios"][label] == pytest.approx(med[a] / med[b]), label
    sizes = res["bytes_on_disk"]
    # Exact precision, compressed: the same state in fewer bytes than torch.save's pickle.
    assert 0 < sizes["smartckpt"] < sizes["torch.save"]
    assert list(work.iterdir()) == [], "the bench left files in its work directory"


def test_bench_refuses_bad_options_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "bench", "--reps", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "--reps" in proc.stderr
