"""The remote tier against a real S3 API (moto's standalone server, started here) and file://.

Real training processes, real SIGKILL/SIGTERM, real files and objects: a wiped local store is
restored from the remote bit-exactly; a damaged local copy is repaired by downloading only the
bad blobs; `smartckpt run --remote` on an empty node resumes; a remote that is down or slow never
blocks or fails training and gets the backlog when it comes back; `verify --remote` finds a lost
object; a preempted run uploads before it exits; an upload killed mid-multipart never yields a
checkpoint that restore accepts; no secret is ever written anywhere.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from smartckpt_cli import CheckpointManager
from smartckpt_cli.ops.demo_train import build
from smartckpt_cli.remote.check import STATUS_FILE
from smartckpt_cli.remote.replica import open_remote, replica_journal
from smartckpt_cli.store import leases
from smartckpt_cli.store.directory import open_store
from tests._s3 import SECRET, MotoServer, all_objects, client, free_port, s3_env
from tests._state import assert_same_state

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moto():
    server = MotoServer(free_port()).start()
    yield server
    server.stop()


@pytest.fixture
def s3(moto, monkeypatch, request):
    """A fresh bucket on the module's server; the AWS_* variables set in this process too."""
    bucket = "b-" + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:50]
    env = s3_env(moto.port)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    client(moto.port).create_bucket(Bucket=bucket)
    return bucket, env


@pytest.fixture(params=["file", "s3"])
def remote(request, tmp_path, monkeypatch):
    """(url, extra env, bucket or None) for either kind of remote."""
    if request.param == "file":
        return f"file://{tmp_path / 'remote'}", {}, None
    bucket, env = request.getfixturevalue("s3")
    return f"s3://{bucket}/runs/one", env, bucket


def _train(
    python: str, store: Path, steps: int, out: Path, *, every: int = 7, step_time: float = 0.0
) -> list[str]:
    return [
        python, "-m", "smartckpt_cli.ops.demo_train", "--dir", str(store), "--steps", str(steps),
        "--save-every", str(every), "--out", str(out), "--step-time", str(step_time),
    ]  # fmt: skip


def _env(child_env: dict[str, str], url: str, extra: dict[str, str], **settings: object) -> dict[str, str]:
    env = {**child_env, **extra, "SMARTCKPT_REMOTE": url}
    for k, v in settings.items():
        env[f"SMARTCKPT_{k.upper()}"] = str(v)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _remote_steps(url: str) -> list[int]:
    state = replica_journal(open_remote(url)).read()
    return sorted(r.step for r in state.live())


def _no_secret_in_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            assert SECRET.encode() not in p.read_bytes(), f"the secret key is in {p}"


# ---------------------------------------------------------------- must show 1: wipe, restore


def test_wiped_store_restores_from_remote_bit_exactly(remote, tmp_path, python, child_env):
    url, extra, bucket = remote
    env = _env(child_env, url, extra)
    store = tmp_path / "store"
    first = _run(_train(python, store, 21, tmp_path / "first.pt"), env)
    assert first.returncode == 0, first.stderr
    assert _remote_steps(url) == [7, 14, 21]  # close() waited for the uploads
    status = json.loads((store / STATUS_FILE).read_text())
    assert status["pending"] == 0 and status["checkpoints_sent"] == 3

    shutil.rmtree(store)  # the node's disk is gone
    second = _run(_train(python, store, 21, tmp_path / "second.pt"), env)
    assert second.returncode == 0, second.stderr
    assert any(line.startswith("restored step 21") for line in second.stdout.splitlines()), second.stdout
    assert "from remote" in second.stderr
    assert_same_state(torch.load(tmp_path / "second.pt"), torch.load(tmp_path / "first.pt"))

    # Credentials only ever came from the environment: nowhere on disk, remote or in the logs.
    assert SECRET not in first.stdout + first.stderr + second.stdout + second.stderr
    _no_secret_in_tree(tmp_path)
    if bucket is not None:
        objects = all_objects(int(extra["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]), bucket)
        assert any(k.startswith("runs/one/journal/") for k in objects)
        assert all(SECRET.encode() not in v for v in objects.values())


# ---------------------------------------------------------------- damaged local copy


def test_damaged_local_copy_is_repaired_downloading_only_bad_blobs(tmp_path, python, child_env, caplog):
    url = f"file://{tmp_path / 'remote'}"
    store = tmp_path / "store"
    done = _run(_train(python, store, 14, tmp_path / "final.pt"), _env(child_env, url, {}))
    assert done.returncode == 0, done.stderr
    manifest = json.loads(sorted((store / "manifests").iterdir())[-1].read_text())
    assert manifest["step"] == 14
    ids = sorted({c[0] for e in manifest["entries"].values() for c in e["data"]["chunks"]})
    path = {b: store / "blobs" / b[:2] / b for b in ids}
    flipped, deleted = ids[0], ids[1]
    data = bytearray(path[flipped].read_bytes())
    data[len(data) // 2] ^= 0xFF
    path[flipped].write_bytes(bytes(data))
    path[deleted].unlink()
    untouched = {b: path[b].stat().st_ino for b in ids[2:]}

    model, opt, sched, loader = build()
    mgr = CheckpointManager(store, remote=url)
    mgr.register(model=model, optimizer=opt, scheduler=sched, data=loader)
    with caplog.at_level("WARNING"):
        assert mgr.restore() == 14  # step 14 itself, repaired: not the fallback to step 7
    mgr.close()
    assert "downloaded 2 blob(s)" in caplog.text, caplog.text
    assert {b: path[b].stat().st_ino for b in ids[2:]} == untouched  # sound blobs never re-fetched
    ref = torch.load(tmp_path / "final.pt")
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref["model"][k]), k


# ---------------------------------------------------------------- smartckpt run on a new node


def test_run_remote_resumes_on_a_new_node(s3, tmp_path, python, child_env):
    bucket, extra = s3
    url = f"s3://{bucket}/job"
    env = {**child_env, **extra, "SMARTCKPT_LOG_EVERY": "0.5"}

    def run(node: str, out: str) -> subprocess.CompletedProcess[str]:
        store = tmp_path / node / "ckpt"
        store.parent.mkdir()
        cmd = [python, "-m", "smartckpt_cli.cli.app", "run", "--dir", str(store), "--remote", url, "--",
               *_train(python, store, 21, tmp_path / out, step_time=0.1)]  # fmt: skip
        return _run(cmd, env)

    first = run("node-a", "a.pt")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "checkpoint(s) not yet remote" in first.stdout, first.stdout  # the status line's lag
    second = run("node-b", "b.pt")  # an empty local directory: a replaced node
    assert second.returncode == 0, second.stdout + second.stderr
    assert "restored step 21" in second.stdout, second.stdout
    (record,) = (tmp_path / "node-b" / "ckpt" / "runs").glob("*.json")
    began = json.loads(record.read_text())["attempts"][0]
    assert (began["start_step"], began["restored_from"]) == (21, "remote"), began  # what the child said
    assert "attempt 0: resumed at step 21 (restored from remote)" in second.stdout
    assert_same_state(torch.load(tmp_path / "b.pt"), torch.load(tmp_path / "a.pt"))
    assert SECRET not in first.stdout + first.stderr + second.stdout + second.stderr


# ---------------------------------------------------------------- must show 2: down, slow, lost


def test_remote_down_never_blocks_training_and_backlog_goes_up_later(
    tmp_path, python, child_env, monkeypatch
):
    port = free_port()  # nothing listens here yet: the remote is down
    extra = s3_env(port)
    url = "s3://late/run"
    store = tmp_path / "store"
    # A new run started deliberately while the remote is down (remote_start_fresh: without it a
    # start with nothing local waits for the remote, test_remote_outage.py); mid-run the outage
    # must cost training nothing.
    env = _env(child_env, url, extra, remote_close_wait=90, remote_start_fresh=1)
    proc = subprocess.Popen(
        _train(python, store, 200, tmp_path / "final.pt", every=5, step_time=0.05),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    server = MotoServer(port)
    stamps: dict[int, float] = {}
    up_at = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step "):
                stamps[int(line.split()[1])] = time.monotonic()
            step = int(line.split()[1]) if line.startswith("step ") else 0
            if server.proc is None and step >= 30 and (store / STATUS_FILE).exists():
                # 6 or more checkpoints committed locally while the remote was down
                status = json.loads((store / STATUS_FILE).read_text())
                if status["last_error"] and status["pending"] >= 1:
                    up_at = step
                    server.start()
                    client(port).create_bucket(Bucket="late")
        rc = proc.wait(120)
        err = proc.stderr.read() if proc.stderr else ""
        assert rc == 0, err
        assert server.proc is not None, "the uploader never reported the remote down"
        gaps = [stamps[n + 1] - stamps[n] for n in range(1, up_at)]
        assert max(gaps) < 3.0, f"a step waited {max(gaps):.2f} s while the remote was down"
        print(f"remote down until step {up_at}: longest step gap {max(gaps):.3f} s")
        live = sorted(r.step for r in open_store(store).journal.read().live())
        for k, v in extra.items():
            monkeypatch.setenv(k, v)
        assert set(live) <= set(_remote_steps(url)), "the backlog was not uploaded"
        status = json.loads((store / STATUS_FILE).read_text())
        assert status["pending"] == 0 and status["last_error"] is None
        assert ("upload failed" in err or "unreachable" in err) and SECRET not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()


def test_slow_remote_never_blocks_the_training_loop(tmp_path):
    url = f"file://{tmp_path / 'remote'}"
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters())
    mgr = CheckpointManager(
        tmp_path / "store", keep_last=20, remote=url, remote_bandwidth_mb=0.5, remote_close_wait=0.5
    )
    mgr.register(model=model, optimizer=opt)
    waits, t0 = [], time.perf_counter()
    for step in range(1, 21):
        model(torch.randn(8, 512)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            h = mgr.save(step)
            h.wait()  # committed locally
            waits.append(h.loop_wait_seconds)
    loop = time.perf_counter() - t0
    status = json.loads((tmp_path / "store" / STATUS_FILE).read_text())
    t1 = time.perf_counter()
    mgr.close()
    closing = time.perf_counter() - t1
    # 10 checkpoints of ~3 MiB each need a minute at 0.5 MiB/s; the loop took a few seconds.
    assert loop < 20, f"the training loop took {loop:.1f} s"
    assert max(waits) < 1.0, waits
    assert status["pending"] >= 5, status  # the remote lags behind, the training does not
    assert closing < 8, f"close waited {closing:.1f} s with remote_close_wait=0.5"
    print(f"slow remote: loop {loop:.2f} s, max loop wait {max(waits) * 1e3:.1f} ms, lag {status['pending']}")


def test_verify_remote_detects_a_lost_object(tmp_path, python, child_env):
    url = f"file://{tmp_path / 'remote'}"
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    with CheckpointManager(tmp_path / "store", remote=url, keep_last=5) as mgr:
        mgr.register(model=model)
        for step in (3, 4, 5):
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.save(step, blocking=True)
    cli = [python, "-m", "smartckpt_cli.cli.app"]
    assert _remote_steps(url) == [3, 4, 5]
    pruned = _run([*cli, "prune", str(tmp_path / "store"), "--keep", "1", "--remote", url], child_env)
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    assert _remote_steps(url) == [5]  # retention applied on both sides
    assert "remote: removed steps 3, 4" in pruned.stdout, pruned.stdout
    ok = _run([*cli, "verify", str(tmp_path / "store"), "--remote", url], child_env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "remote step 5" in ok.stdout and "ok" in ok.stdout
    shown = _run([*cli, "inspect", str(tmp_path / "store"), "--remote", url], child_env)
    assert "0 committed checkpoint(s) not yet remote" in shown.stdout, shown.stdout
    blob = next((tmp_path / "remote" / "blobs").rglob("*"))
    while blob.is_dir():
        blob = next(blob.iterdir())
    blob.unlink()  # the object store lost an object
    bad = _run([*cli, "verify", str(tmp_path / "store"), "--remote", url], child_env)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    # the same line as a local verify's: which entry lost which blob
    assert re.search(rf"remote step 5 \(\w+\): CORRUPT: .*missing blob {blob.name}", bad.stdout), bad.stdout
    assert "Traceback" not in bad.stderr


# ---------------------------------------------------------------- preemption, must show 3


def test_preemption_uploads_before_exit(tmp_path, python, child_env):
    url = f"file://{tmp_path / 'remote'}"
    store = tmp_path / "store"
    env = _env(child_env, url, {}, remote_bandwidth_mb=0.05)  # ~1 s per checkpoint
    proc = subprocess.Popen(
        _train(python, store, 400, tmp_path / "final.pt", every=1000, step_time=0.02),
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 10 "):
            proc.send_signal(signal.SIGTERM)
            break
    proc.stdout.read()
    rc = proc.wait(60)
    assert rc in (-signal.SIGTERM, 128 + signal.SIGTERM), rc
    local = [r.step for r in open_store(store).journal.read().live()]
    assert len(local) == 1 and local[0] >= 10  # the preemption checkpoint, the only one
    assert _remote_steps(url) == local


def test_sigkill_mid_multipart_never_yields_a_remote_checkpoint(s3, tmp_path, python, child_env):
    bucket, extra = s3
    url = f"s3://{bucket}/big"
    port = int(extra["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    script = tmp_path / "big.py"
    script.write_text(
        "import sys, time, torch\n"
        "from smartckpt_cli import CheckpointManager\n"
        "torch.manual_seed(0)\n"
        "w = torch.nn.Parameter(torch.randn(2048, 2048))  # 16 MiB: a multipart blob\n"
        "m = torch.nn.ParameterDict({'w': w})\n"
        "phase = sys.argv[2]\n"
        "mgr = CheckpointManager(sys.argv[1], remote=sys.argv[3], remote_part_mb=5,\n"
        "                        remote_bandwidth_mb=0 if phase == 'one' else 3)\n"
        "mgr.register(model=m)\n"
        "start = mgr.restore()\n"
        "if phase == 'two':\n"
        "    with torch.no_grad(): w.add_(1.0)\n"
        "mgr.save(start + 1, blocking=True)\n"
        "print('committed', start + 1, flush=True)\n"
        "if phase == 'one':\n"
        "    mgr.close(); torch.save(m.state_dict(), sys.argv[4])\n"
        "else:\n"
        "    time.sleep(600)\n"
    )
    env = {**child_env, **extra}
    store = tmp_path / "store"
    one = _run([python, str(script), str(store), "one", url, str(tmp_path / "one.pt")], env)
    assert one.returncode == 0, one.stderr
    assert _remote_steps(url) == [1]

    proc = subprocess.Popen([python, str(script), str(store), "two", url], env=env, stdout=subprocess.PIPE)
    s3c = client(port)
    parts = 0
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline and not parts:
            for up in s3c.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
                parts = len(
                    s3c.list_parts(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"]).get("Parts", [])
                )
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    assert parts >= 1, "never saw a multipart upload in progress"
    print(f"killed with {parts} part(s) of a multipart upload sent")
    assert _remote_steps(url) == [1]  # step 2 never committed remotely

    # A new node: whatever the killed upload left, restore takes step 1, bit-exactly.
    torch.manual_seed(0)
    m = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(2048, 2048))})
    with CheckpointManager(tmp_path / "node-b", remote=url) as mgr:
        mgr.register(model=m)
        assert mgr.restore() == 1
    assert torch.equal(m["w"], torch.load(tmp_path / "one.pt")["w"])
    verify = _run(
        [python, "-m", "smartckpt_cli.cli.app", "verify", str(tmp_path / "node-b"), "--remote", url, "--all"],
        env,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_verify_and_inspect_read_a_replica_by_its_url_as_they_read_a_directory(
    remote, tmp_path, python, child_env
):
    """One verify: `smartckpt verify URL` runs the local verify over the replica's backend (an
    object store or a directory); inspect lists it; prune by URL waits for no upload
    (a lease in the replica) and keeps the newest."""
    url, extra, _ = remote
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    with CheckpointManager(tmp_path / "store", remote=url, keep_last=5, remote_close_wait=60) as mgr:
        mgr.register(model=model)
        for step in (3, 4):
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.save(step, blocking=True)
    env = {**child_env, **extra}
    cli = [python, "-m", "smartckpt_cli.cli.app"]
    ok = _run([*cli, "verify", url, "--all"], env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert re.findall(r"^step (\d+) \(\w+\): ok$", ok.stdout, re.M) == ["4", "3"], ok.stdout
    listed = _run([*cli, "inspect", url, "--json"], env)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert sorted(r["step"] for r in json.loads(listed.stdout)["checkpoints"]) == [3, 4], listed.stdout
    local = _run([*cli, "inspect", str(tmp_path / "store"), "--json"], env)
    assert json.loads(local.stdout)["store_id"] == json.loads(listed.stdout)["store_id"]
    # the replica loses a blob: the same line as a local verify's, exit 1 (then a prune keeps
    # the newest by the journal's rule, as --remote does)
    store = open_store(tmp_path / "store")
    bid = sorted(store.blobs.all_ids())[0]
    replica = open_remote(url)
    replica.remove(f"blobs/{bid[:2]}/{bid}")
    bad = _run([*cli, "verify", url, "--all"], env)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"missing blob {bid}" in bad.stdout and "Traceback" not in bad.stderr, bad.stdout + bad.stderr
    # prune by URL: refused while an upload holds a lease on the replica, then done
    upload = leases.take(replica, "upload")
    refused = _run([*cli, "prune", url, "--keep", "1"], env)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stderr.count("\n") == 1 and "being written (upload by pid" in refused.stderr, (
        refused.stderr
    )
    assert sorted(r.step for r in replica_journal(replica).read().live()) == [3, 4]  # nothing removed
    replica.remove(upload.rel)
    pruned = _run([*cli, "prune", url, "--keep", "1"], env)
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    assert "remote: removed steps 3; kept steps 4" in pruned.stdout, pruned.stdout
    assert sorted(r.step for r in replica_journal(replica).read().live()) == [4]
    assert not replica.list("locks")  # the prune's own lease is gone
    nothing = _run([*cli, "verify", f"{url}-none"], env)
    assert nothing.returncode == 2 and "no journal" in nothing.stderr, nothing.stdout + nothing.stderr
