"""``inspect`` and ``export`` of a checkpoint written by several ranks (issue 21): a real store
made by torchrun (FSDP2 on 2 CPU ranks, gloo; ``tests/scripts/elastic_train.py``). inspect shows
the world size and the sharding from the manifest JSON (without torch); export writes one file
whose tensors are whole, equal bit for bit to the state the ranks gathered themselves."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from smartckpt_cli.cli.app import app

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "elastic_train.py"
SHARDED = 12  # 4 parameters and their 8 Adam moments, each Shard(0) over 2 ranks

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The store (steps 3 and 6, both by 2 ranks) and the full state rank 0 gathered at step 6."""
    base = tmp_path_factory.mktemp("sharded")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(SCRIPT), "--dir", "ck", "--total", "6", "--save-every", "3", "--dump", "."]
    proc = subprocess.run(cmd, cwd=base, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return base / "ck", torch.load(base / "saved-6.pt", weights_only=True)


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 34), torch.nn.Tanh(), torch.nn.Linear(34, 5))


def _bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].view(torch.int32), v.view(torch.int32)), k  # bits, not values


def _loads_into_plain_model(sd: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    model = _net()
    model.load_state_dict(sd, strict=True)
    _bitwise(dict(model.state_dict()), want)


def test_inspect_list_shows_world_size_and_sharding(store: tuple[Path, dict]) -> None:
    ck, _ = store
    result = runner.invoke(app, ["inspect", str(ck)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "ranks" in result.stdout
    rows = [line for line in result.stdout.splitlines() if "manual" in line]
    assert len(rows) == 2 and all(f"2 S0×{SHARDED}" in line for line in rows), result.stdout

    result = runner.invoke(app, ["inspect", str(ck), "--json"])
    assert result.exit_code == 0, result.output
    checkpoints = json.loads(result.stdout)["checkpoints"]
    assert [c["step"] for c in checkpoints] == [6, 3]
    for c in checkpoints:
        assert c["world_size"] == 2 and c["sharded"] == SHARDED and c["sharding"] == f"S0×{SHARDED}"


def test_inspect_detail_shows_the_sharding_and_global_shapes(store: tuple[Path, dict]) -> None:
    ck, _ = store
    result = runner.invoke(app, ["inspect", str(ck), "--step", "6"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert (
        f"world size 2: {SHARDED} tensors sharded (Shard(0)), shapes below are rank 0's shard; "
        "restorable at any world size"
    ) in result.stdout
    assert "17x16 of 34x16" in result.stdout and "3x34 of 5x34" in result.stdout

    result = runner.invoke(app, ["inspect", str(ck), "--step", "6", "--json"])
    assert result.exit_code == 0, result.output
    detail = json.loads(result.stdout)
    assert detail["world_size"] == 2 and detail["sharded"] == SHARDED
    assert detail["restorable_at_any_world_size"] is True
    entries = {e["key"]: e for e in detail["entries"]}
    assert entries["model/0.weight"]["shape"] == [17, 16]
    assert entries["model/0.weight"]["global_shape"] == [34, 16]
    assert entries["model/0.weight"]["placements"] == ["S0"]
    assert entries["optimizer/state/0/step"]["global_shape"] is None


def test_inspect_of_a_sharded_store_does_not_import_torch(store: tuple[Path, dict], tmp_path: Path) -> None:
    ck, _ = store
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text('raise ImportError("the control plane imported torch")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    for args in (["inspect", str(ck), "--json"], ["inspect", str(ck), "--step", "6"]):
        proc = subprocess.run(
            [sys.executable, "-m", "smartckpt_cli.cli.app", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert "world size 2" in proc.stdout or '"world_size": 2' in proc.stdout


def test_export_torch_is_whole_and_loads_into_an_unsharded_model(
    store: tuple[Path, dict], tmp_path: Path
) -> None:
    ck, saved = store
    out = tmp_path / "model.pt"
    result = runner.invoke(app, ["export", str(ck), str(out), "--weights-only"])
    assert result.exit_code == 0, result.output
    assert "exported step 6" in result.stdout and "consolidated from 2 ranks" in result.stdout
    _loads_into_plain_model(torch.load(out, weights_only=True), saved["model"])

    out = tmp_path / "full.pt"
    result = runner.invoke(app, ["export", str(ck), str(out)])
    assert result.exit_code == 0, result.output
    full = torch.load(out, weights_only=True)
    assert full["smartckpt"]["step"] == 6 and full["smartckpt"]["world_size"] == 2
    _loads_into_plain_model(full["model"], saved["model"])
    for pid, state in saved["optimizer"].items():  # the moments whole too
        for k, v in state.items():
            assert torch.equal(full["optimizer"]["state"][pid][k], v), (pid, k)
    opt = torch.optim.AdamW(_net().parameters())
    opt.load_state_dict(full["optimizer"])


def test_export_safetensors_is_whole_and_loads_without_smartckpt(
    store: tuple[Path, dict], tmp_path: Path
) -> None:
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    ck, saved = store
    out = tmp_path / "model.safetensors"
    result = runner.invoke(app, ["export", str(ck), str(out), "--weights-only", "--format", "safetensors"])
    assert result.exit_code == 0, result.output
    _loads_into_plain_model(load_file(out), saved["model"])
    # In a process that never imports smartckpt: torch and safetensors alone.
    code = (
        "import sys, torch; from safetensors.torch import load_file; "
        "m = torch.nn.Sequential(torch.nn.Linear(16, 34), torch.nn.Tanh(), torch.nn.Linear(34, 5)); "
        "m.load_state_dict(load_file(sys.argv[1]), strict=True); "
        "assert 'smartckpt_cli' not in sys.modules; print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr

    out = tmp_path / "full.safetensors"
    result = runner.invoke(app, ["export", str(ck), str(out), "--format", "safetensors"])
    assert result.exit_code == 0, result.output
    flat = load_file(out)
    _bitwise({k.removeprefix("model/"): v for k, v in flat.items() if k.startswith("model/")}, saved["model"])
    assert torch.equal(flat["optimizer/state/0/exp_avg"], saved["optimizer"][0]["exp_avg"])


def test_ddp_store_shows_two_ranks_nothing_sharded_and_exports_rank_0s_weights(tmp_path: Path) -> None:
    """DDP: every rank holds whole tensors; inspect says 2 ranks and nothing sharded, export
    writes the weights as every rank holds them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(ROOT / "tests" / "scripts" / "ddp_train.py"), "--mode", "ddp", "--total", "10"]
    cmd += ["--every", "5", "--dir", "ck", "--out", "final"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ck = tmp_path / "ck"

    result = runner.invoke(app, ["inspect", str(ck), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["checkpoints"]
    assert [(r["step"], r["world_size"], r["sharded"], r["sharding"]) for r in rows] == [
        (10, 2, 0, "-"),
        (5, 2, 0, "-"),
    ]
    result = runner.invoke(app, ["inspect", str(ck), "--step", "10"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "world size 2: no tensor sharded" in result.stdout
    assert "restorable at any world size" in result.stdout

    out = tmp_path / "w.pt"
    result = runner.invoke(app, ["export", str(ck), str(out), "--weights-only"])
    assert result.exit_code == 0, result.output
    got = torch.load(out, weights_only=True)
    for rank in (0, 1):  # DDP: the same weights on both ranks
        want = torch.load(tmp_path / f"final.r{rank}", weights_only=True)["model"]
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want)


def _part_blobs(directory: Path, part: list) -> set[str]:
    """The blob ids a part manifest's own entries reference (not those it refers to by ``ref``)."""
    manifest = json.loads((directory / part[0]).read_bytes())
    out: set[str] = set()
    for entry in manifest["entries"].values():
        for stream in (entry.get("data"), entry.get("patch")):
            out.update(str(c[0]) for c in (stream or {}).get("chunks", []))
    return out


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def test_verify_checks_every_ranks_part_and_names_the_rank_of_a_damaged_one(
    store: tuple[Path, dict], tmp_path: Path
) -> None:
    """A shared dir holds both ranks' parts: verify checks both. Damage to a blob that only rank
    1's part references (a shard of its own) is found and named with the rank."""
    ck = tmp_path / "ck"
    shutil.copytree(store[0], ck)
    result = runner.invoke(app, ["verify", str(ck), "--all", "--json", "--no-record"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["results"]
    assert [(r["step"], r["ranks_checked"], r["ranks_elsewhere"]) for r in rows] == [
        (6, [0, 1], []),
        (3, [0, 1], []),
    ]

    commit = [json.loads(line) for line in (ck / "journal.jsonl").read_text().splitlines()]
    parts = next(e for e in commit if e["event"] == "commit" and e["step"] == 6)["parts"]
    only_rank1 = sorted(_part_blobs(ck, parts[1]) - _part_blobs(ck, parts[0]))
    assert only_rank1, "rank 1's shards share every blob with rank 0's"
    _flip_a_byte(ck / "blobs" / only_rank1[0][:2] / only_rank1[0])
    result = runner.invoke(app, ["verify", str(ck), "--step", "6", "--no-record"])
    assert result.exit_code == 1, result.output
    assert "CORRUPT: rank 1: " in result.stdout and f"hash mismatch in blob {only_rank1[0]}" in result.stdout
    assert "rank 0:" not in result.stdout, result.stdout


def test_verify_of_node_local_dirs_checks_the_parts_each_holds_and_names_the_others(tmp_path: Path) -> None:
    """Node-local dirs: each holds its own rank's part. verify of one names the other rank's part
    as written elsewhere (not damage, exit 0); damage on node 1 is found from node 1's dir only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(ROOT / "tests" / "scripts" / "ddp_train.py"), "--mode", "ddp", "--total", "10"]
    cmd += ["--every", "5", "--dir", "local", "--node-local", "--meta-dir", "shared"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    shared = ["--meta-dir", str(tmp_path / "shared")]

    for rank in (0, 1):
        node = tmp_path / "local" / f"node{rank}"
        result = runner.invoke(app, ["verify", str(node), *shared, "--json", "--no-record"])
        assert result.exit_code == 0, result.output
        row = json.loads(result.stdout)["results"][0]
        assert (row["step"], row["ranks_checked"], row["ranks_elsewhere"]) == (10, [rank], [1 - rank])
    result = runner.invoke(
        app, ["verify", str(tmp_path / "local" / "node0"), *shared], env={"COLUMNS": "300"}
    )
    assert "ok (parts checked here: rank 0; rank 1 wrote to another disk" in result.stdout, result.stdout

    node1 = tmp_path / "local" / "node1"
    journal = [json.loads(line) for line in (tmp_path / "shared" / "journal.jsonl").read_text().splitlines()]
    parts = next(e for e in journal if e["event"] == "commit" and e["step"] == 10)["parts"]
    bid = sorted(_part_blobs(node1, parts[1]))[0]
    blob = node1 / "blobs" / bid[:2] / bid
    _flip_a_byte(blob)
    result = runner.invoke(app, ["verify", str(node1), *shared, "--no-record"])
    assert result.exit_code == 1 and "rank 1: " in result.stdout and blob.name in result.stdout, result.output
    result = runner.invoke(app, ["verify", str(tmp_path / "local" / "node0"), *shared, "--no-record"])
    assert result.exit_code == 0, result.output
