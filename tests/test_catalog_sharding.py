"""``ops/catalog.py``'s sharding summary, from manifest JSON alone: DTensor nodes of the object
skeletons, counted and named; what a 2-D mesh reads as; a single-process store shows 1 rank."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

import smartckpt_cli as sc
from smartckpt_cli.cli.app import app
from smartckpt_cli.ops.catalog import Row, dtensor_nodes, sharding_summary
from smartckpt_cli.ops.detail import EntryRow, ManifestDetail

runner = CliRunner()


def _manifest(placements: list[str]) -> dict:
    return {
        "objects": {
            "model": {
                "kind": "module",
                "tree": {
                    "w": {"__dt": ["model/w", [8, 4], placements]},
                    "b": {"__dt": ["model/b", [8], ["R"]]},
                    "n": {"__t": "model/n"},
                },
            },
            "optimizer": {
                "kind": "optimizer",
                "tree": {"state": {"__map": [[0, {"m": {"__dt": ["optimizer/m", [8, 4], placements]}}]]}},
            },
        }
    }


def _detail(placements: list[str], world: int) -> ManifestDetail:
    nodes = dtensor_nodes(_manifest(placements))
    n, summary = sharding_summary(nodes)
    row = Row(3, "x", "live", None, "manual", None, "ok", ["L1"], "exact", 0, 0, 0, 0, "never")
    row.world_size, row.sharded, row.sharding = world, n, summary
    entries = [
        EntryRow(k, "L1", "float32", [4, 4], "float32", "none", 1, 0, 0, 0, shape, pl)
        for k, (shape, pl) in nodes.items()
    ]
    return ManifestDetail(row, "m.json", {}, {}, entries, [])


def test_dtensor_nodes_and_summary() -> None:
    nodes = dtensor_nodes(_manifest(["S0"]))
    assert nodes == {"model/w": ([8, 4], ["S0"]), "model/b": ([8], ["R"]), "optimizer/m": ([8, 4], ["S0"])}
    assert sharding_summary(nodes) == (2, "S0×2")  # a Replicate DTensor is not sharded
    assert sharding_summary({}) == (0, "-")
    assert sharding_summary(dtensor_nodes(_manifest(["S0", "R"]))) == (2, "S0,R×2")


def test_sharding_line() -> None:
    line = _detail(["S0"], 2).sharding_line()
    assert line == (
        "world size 2: 2 tensors sharded (Shard(0)), shapes below are rank 0's shard; "
        "restorable at any world size"
    )
    two_d = _detail(["S0", "R"], 4)
    assert not two_d.any_world_size
    assert "2 tensors sharded (Shard(0), Replicate)" in (two_d.sharding_line() or "")
    assert "restorable at this world size only" in (two_d.sharding_line() or "")
    assert _detail(["R"], 1).sharding_line() is None  # one process, nothing sharded


def test_single_process_store_shows_one_rank(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    with sc.CheckpointManager(tmp_path, eval_every=1, max_interval=3600) as mgr:
        mgr.register(model=model)
        mgr.save(1, blocking=True)
    result = runner.invoke(app, ["inspect", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["checkpoints"]
    assert (row["world_size"], row["sharded"], row["sharding"]) == (1, 0, "-")
    result = runner.invoke(app, ["inspect", str(tmp_path), "--step", "1"])
    assert result.exit_code == 0, result.output
    assert "world size 1:" not in result.stdout and " of " not in result.stdout
    detail = json.loads(runner.invoke(app, ["inspect", str(tmp_path), "--step", "1", "--json"]).stdout)
    assert detail["world_size"] == 1 and detail["sharded"] == 0
    assert all(e["global_shape"] is None for e in detail["entries"])
