"""SIGKILL at every stage of a save leaves the previous checkpoint restorable and the partial one
ignored; the leftovers are collected by the next save's retention.

Each scenario is a real child process that trains a tiny model with AdamW and saves (blocking)
at steps 1, 2, 3. ``SMARTCKPT_TEST_FAULTS=1`` + ``SMARTCKPT_FAULT=<point>@N`` make it SIGKILL
itself the N-th time it passes a named fault point in the library. Before every save the child
``torch.save``s its exact state to a side file, so the test can compare bit for bit what a
restore loads with what the child had at that step.

A module fixture runs every scenario once (a forking "zygote" process, so torch is imported once);
each test then examines its own store in this process: restore, bit-exact comparison, then one
more save whose retention must collect the dead save's garbage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from smartckpt_cli import CheckpointManager
from smartckpt_cli.ops.verify import verify_store
from smartckpt_cli.store.journal import Journal
from smartckpt_cli.store.storage.local import LocalStorage

REPO = Path(__file__).resolve().parents[1]

# One real process imports torch once (about 4 s here, AdamW pulls in torch._dynamo), then forks
# a fresh child per scenario. A fork is a real process: the fault point SIGKILLs it for real, and
# its parent only sees the exit status, as a supervisor would.
ZYGOTE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from smartckpt_cli import CheckpointManager

    torch.set_num_threads(1)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    build()  # warm up the lazy imports before forking

    def train_and_save(store, refdir, keep_last):
        model, opt = build()
        # workers=1: blobs are written one after the other: "the N-th blob" is deterministic.
        mgr = CheckpointManager(store, keep_last=keep_last, chunk_mb=1, workers=1)
        mgr.register(model=model, optimizer=opt)
        for step in (1, 2, 3):
            x = torch.randn(16, 32)  # consumes the torch RNG: its state differs per checkpoint
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            torch.save(
                {"model": model.state_dict(), "optimizer": opt.state_dict(),
                 "torch_rng": torch.get_rng_state()},
                os.path.join(refdir, f"ref-{step}.pt"),
            )
            info = mgr.save(step, blocking=True).wait()
            assert info is not None and info.step == step, mgr.failures
            n = sum(len(files) for _, _, files in os.walk(os.path.join(store, "blobs")))
            print(f"saved {step} {n}", flush=True)
        assert mgr.close() == []

    def run(work, fault, keep_last):
        os.makedirs(os.path.join(work, "refs"))
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.chdir(work)  # no stray ./smartckpt.yaml
                for fd, name in ((1, "stdout"), (2, "stderr")):
                    f = os.open(os.path.join(work, name), os.O_WRONLY | os.O_CREAT, 0o644)
                    os.dup2(f, fd)
                if fault:
                    os.environ["SMARTCKPT_TEST_FAULTS"] = "1"
                    os.environ["SMARTCKPT_FAULT"] = fault
                train_and_save(os.path.join(work, "store"), os.path.join(work, "refs"), keep_last)
                code = 0
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

    base, cases = sys.argv[1], json.loads(sys.argv[2])
    results = {"probe": run(os.path.join(base, "probe"), None, 10)}
    if results["probe"] != 0:
        with open(os.path.join(base, "probe", "stderr")) as f:
            sys.exit("probe run failed: " + f.read())
    # The probe keeps every blob: how many new blobs does each save write?
    with open(os.path.join(base, "probe", "stdout")) as f:
        counts = {int(s): int(n) for _, s, n in (line.split() for line in f)}
    first, second = counts[1], counts[2] - counts[1]
    hit = {"first": first + 1, "last": first + second}
    for name, (point, at) in cases.items():
        fault = f"{point}@{hit[at] if at in hit else int(at)}"
        results[name] = (run(os.path.join(base, name), fault, 1), fault)
    results["blobs_per_save"] = [first, second]
    print(json.dumps(results))
    """
)


@dataclass(frozen=True)
class Case:
    point: str
    at: str  # "first"/"last" new blob of the 2nd save, or a literal hit number
    expect_step: int  # the step a restore must return after the crash


CASES: dict[str, Case] = {
    # During the 2nd save, before its commit line: step 1 must come back.
    "blob.written-first": Case("blob.written", "first", 1),
    "blob.written-last": Case("blob.written", "last", 1),
    "blob.renamed-first": Case("blob.renamed", "first", 1),
    "blob.renamed-last": Case("blob.renamed", "last", 1),
    "blob.stored-first": Case("blob.stored", "first", 1),
    "blob.stored-last": Case("blob.stored", "last", 1),
    "blobs.durable": Case("blobs.durable", "2", 1),
    "manifest.written": Case("manifest.written", "2", 1),
    "manifest.renamed": Case("manifest.renamed", "2", 1),
    "journal.half_line": Case("journal.half_line", "2", 1),
    # After the commit line is durable: the new checkpoint exists.
    "journal.fsynced": Case("journal.fsynced", "2", 2),
    # Retention after the 2nd commit (keep_last=1 prunes step 1), killed between the journal's
    # prune line and removing the files.
    "prune.in_progress": Case("prune.in_progress", "1", 2),
    # The very first save dies: nothing to restore, the objects stay as they are.
    "first-save.blob.written": Case("blob.written", "1", 0),
    # 3rd save, after step 1 was pruned and garbage-collected: step 2 must be intact.
    "third-save.blobs.durable": Case("blobs.durable", "3", 2),
}


@dataclass
class Run:
    store: Path
    refs: Path
    returncode: int
    stdout: str
    stderr: str
    spec: str


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    base = tmp_path_factory.mktemp("crash")
    (base / "zygote.py").write_text(ZYGOTE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    cases = {name: (c.point, c.at) for name, c in CASES.items()}
    proc = subprocess.run(
        [sys.executable, str(base / "zygote.py"), str(base), json.dumps(cases)],
        cwd=base,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    first, second = results.pop("blobs_per_save")
    assert first >= 3 and second >= 3, "each save should write several new blobs"

    def load(name: str, code: int, spec: str) -> Run:
        work = base / name
        return Run(
            work / "store",
            work / "refs",
            code,
            (work / "stdout").read_text(),
            (work / "stderr").read_text(),
            spec,
        )

    out = {"probe": load("probe", results.pop("probe"), "")}
    for name, (code, spec) in results.items():
        out[name] = load(name, code, spec)
    return out


# restore() loads RNG state into this process: `isolated` puts the test process's back.
pytestmark = pytest.mark.usefixtures("isolated")


def _fresh_objects() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(12345)  # different init from the child: a restore must overwrite it
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _blob_files(store: Path) -> set[str]:
    return {p.name for p in (store / "blobs").rglob("*") if p.is_file() and ".tmp." not in p.name}


def _manifest_blobs(path: Path) -> set[str]:
    manifest = json.loads(path.read_bytes())
    out = set()
    for entry in manifest["entries"].values():
        for stream in (entry["data"], entry.get("patch")):
            out |= {chunk[0] for chunk in (stream or {}).get("chunks", [])}
    return out


def _journal(store: Path):
    return Journal(LocalStorage(store), store).read()


def _assert_state_equals(model, opt, ref: dict) -> None:
    for key, want in ref["model"].items():
        assert torch.equal(model.state_dict()[key], want), key
    got_opt = opt.state_dict()
    assert got_opt["param_groups"] == ref["optimizer"]["param_groups"]
    assert set(got_opt["state"]) == set(ref["optimizer"]["state"])
    for pid, st in ref["optimizer"]["state"].items():
        for name, want in st.items():
            assert torch.equal(got_opt["state"][pid][name], want), (pid, name)
    assert torch.equal(torch.get_rng_state(), ref["torch_rng"])


def _assert_crash_site(name: str, run: Run) -> None:
    """Evidence that the child died where the case says, not somewhere else."""
    store = run.store
    state = _journal(store)
    committed = [r.step for r in state.records]
    tmps = [p for p in _files(store) if ".tmp." in p.name]
    manifests = sorted((store / "manifests").glob("*.json")) if (store / "manifests").exists() else []
    point = CASES[name].point
    if name.startswith("first-save"):
        assert committed == [] and tmps, (committed, tmps)
        return
    if name.startswith("third-save"):
        assert committed == [1, 2] and [r.step for r in state.live()] == [2]
        assert len(manifests) == 1  # step 2's; step 3 died before its manifest
        return
    if CASES[name].expect_step == 1:
        assert committed == [1], f"step 2 must not be committed: {committed}"
        step1 = store / state.records[0].manifest
        orphans = _blob_files(store) - _manifest_blobs(step1)
        if point in ("blob.written", "blob.stored"):  # stored: in a temporary file, not yet fsynced
            assert any(p.parent.parent.name == "blobs" for p in tmps), tmps
        if point in ("blob.renamed", "blobs.durable"):
            assert orphans, "blobs of the dead save should be on disk"
        if point == "manifest.written":
            assert any(p.parent.name == "manifests" for p in tmps), tmps
        if point == "manifest.renamed":
            assert len(manifests) == 2, "the uncommitted step-2 manifest should be on disk"
        if point == "journal.half_line":
            raw = (store / "journal.jsonl").read_bytes()
            assert not raw.endswith(b"\n") and state.problems, "expected a torn last line"
        return
    assert committed == [1, 2]
    if point == "journal.fsynced":
        assert [r.step for r in state.live()] == [1, 2]  # killed before retention
    if point == "prune.in_progress":
        assert [r.step for r in state.live()] == [2]
        assert len(manifests) == 2, "killed before the pruned manifest was removed"


def test_probe_run_is_clean(runs: dict[str, Run]) -> None:
    probe = runs["probe"]
    assert probe.returncode == 0
    state = _journal(probe.store)
    assert [r.step for r in state.records] == [1, 2, 3] and not state.problems
    results, _ = verify_store(_open_store_readonly(probe.store), all_checkpoints=True)
    assert [(r.step, r.ok) for r in results] == [(3, True), (2, True), (1, True)]


def _open_store_readonly(path: Path):
    from smartckpt_cli.store.directory import open_store

    return open_store(path)


@pytest.mark.parametrize("name", list(CASES))
def test_sigkill_leaves_previous_checkpoint_restorable(
    name: str, runs: dict[str, Run], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    run, case = runs[name], CASES[name]
    assert run.returncode == -9, f"child should die by SIGKILL ({run.spec}); stderr:\n{run.stderr}"
    _assert_crash_site(name, run)

    model, opt = _fresh_objects()
    untouched = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager(run.store, keep_last=1, chunk_mb=1) as mgr:
        mgr.register(model=model, optimizer=opt)
        assert mgr.restore() == case.expect_step
        if case.expect_step == 0:
            for key, want in untouched.items():
                assert torch.equal(model.state_dict()[key], want), key
            assert opt.state_dict()["state"] == {}
        else:
            assert mgr.last_restore is not None and mgr.last_restore["step"] == case.expect_step
            ref = torch.load(run.refs / f"ref-{case.expect_step}.pt", weights_only=True)
            _assert_state_equals(model, opt, ref)

        # Training goes on: the next save commits and its retention collects the dead save's
        # leftovers (tmp files, uncommitted manifests, unreferenced blobs).
        x = torch.randn(16, 32)
        model(x).pow(2).mean().backward()
        opt.step()
        new_step = case.expect_step + 10
        want_after = {k: v.clone() for k, v in model.state_dict().items()}
        info = mgr.save(new_step, blocking=True).wait()
        assert info is not None and info.step == new_step, mgr.failures
        if case.expect_step == 0:
            # Only one checkpoint: nothing to prune, so retention has not run yet. Save again.
            info = mgr.save(new_step + 1, blocking=True).wait()
            assert info is not None, mgr.failures
            new_step += 1

    store = run.store
    leftovers = [p for p in _files(store) if ".tmp." in p.name]
    assert leftovers == [], f"temporary files were not collected: {leftovers}"
    state = _journal(store)
    live = state.live()
    assert [r.step for r in live] == [new_step]
    on_disk = {f"manifests/{p.name}" for p in (store / "manifests").iterdir()}
    assert on_disk == {r.manifest for r in state.records if not r.pruned}
    referenced = _manifest_blobs(store / live[0].manifest)
    assert _blob_files(store) == referenced, "unreferenced blobs survived garbage collection"

    model2, opt2 = _fresh_objects()
    with CheckpointManager(store, create=False) as mgr:
        mgr.register(model=model2, optimizer=opt2)
        assert mgr.restore() == new_step
    for key, want in want_after.items():
        assert torch.equal(model2.state_dict()[key], want), key
    results, _ = verify_store(_open_store_readonly(store), all_checkpoints=True)
    assert [(r.step, r.ok) for r in results] == [(new_step, True)]
