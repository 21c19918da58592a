"""Secrets are never on disk and never printed.

A real ``smartckpt run`` with a real S3 API (moto's server) and a training script that is
SIGKILLed once and restarted, with secrets planted in the three places a user puts them: the
remote URL's userinfo (a secret holding ``/``, as AWS secret keys often do, which ``urlsplit``
alone would miss), an option of the script (``--hf-token=...``, ``--api-key X``), and the
environment (``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``). Then every file under the store, the run
directory, the remote bucket and every line the run printed are read: no secret appears anywhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from smartckpt_cli.redact import redact_argv, redact_url
from tests._s3 import SECRET, MotoServer, all_objects, client, free_port, s3_env

URL_SECRET = "uRL/sEcReT+with/slashes=="
TOKEN = "hf_optionTOKENsecret123"
API_KEY = "apiKEYsecret456"
ENV_TOKEN = "hf_envTOKENsecret789"

SCRIPT = """
import argparse, os, signal, torch, smartckpt_cli
p = argparse.ArgumentParser()
p.add_argument("--hf-token"); p.add_argument("--api-key"); p.add_argument("--total", type=int)
a = p.parse_args()
assert a.hf_token and a.api_key and os.environ["HF_TOKEN"]  # the script gets its secrets
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
start = smartckpt_cli.start_step()
print("start", start, flush=True)
for step in range(start, a.total):
    opt.zero_grad(); model(torch.randn(3, 4)).sum().backward(); opt.step()
    print("step", step + 1, flush=True)
    if step + 1 == 7 and os.environ.get("SMARTCKPT_ATTEMPT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_planted_secrets_appear_nowhere(tmp_path: Path, child_env: dict[str, str]) -> None:
    server = MotoServer(free_port()).start()
    try:
        env = {**child_env, **s3_env(server.port), "HF_TOKEN": ENV_TOKEN, "SMARTCKPT_RESTART_BACKOFF": "0.1"}
        client(server.port).create_bucket(Bucket="bkt")
        (tmp_path / "train.py").write_text(SCRIPT)
        url = f"s3://AKIAEXAMPLE:{URL_SECRET}@bkt/runs/one"
        done = subprocess.run(
            [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "--every", "3",
             "--remote", url, "train.py", f"--hf-token={TOKEN}", "--api-key", API_KEY, "--total", "12"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        assert "restart" in out.lower(), out  # the kill happened and the run was restarted
        objects = all_objects(server.port, "bkt")
    finally:
        server.stop()

    secrets = [URL_SECRET, TOKEN, API_KEY, ENV_TOKEN, SECRET, "AKIAEXAMPLE"]
    # where it looked: the printed log, every file of the working directory (store, run records,
    # the run directory's hooks/heartbeat/error files, traces, status files), every remote object
    looked = {"log lines": out.count("\n")}
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "train.py"]
    looked["files"] = len(files)
    looked["remote objects"] = len(objects)
    assert looked["files"] > 10 and looked["remote objects"] > 5, looked
    for secret in secrets:
        assert secret not in out, f"{secret!r} printed"
        for p in files:
            assert secret.encode() not in p.read_bytes(), f"{secret!r} written to {p}"
        for key, body in objects.items():
            assert secret.encode() not in body and secret not in key, f"{secret!r} in remote object {key}"
    # what was recorded is still useful: the command with the secrets masked, the remote's place
    (record,) = (tmp_path / "ck" / "runs").glob("*.json")
    rec = json.loads(record.read_text())
    assert rec["command"][-5:] == ["--hf-token=***", "--api-key", "***", "--total", "12"], rec["command"]
    assert rec["settings"]["remote"] == "s3://bkt/runs/one"
    hooks = [json.loads(p.read_text()) for p in (tmp_path / "ck" / "runs").rglob("hooks.*.json")]
    assert hooks and all("--hf-token=***" in h["argv"] for h in hooks), hooks


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("s3://KEY:SE/CR/ET@bucket/prefix", "s3://bucket/prefix"),
        ("s3://KEY:a?b#c@bucket/p", "s3://bucket/p"),
        ("gs://token@bucket/p", "gs://bucket/p"),
        (
            "https://u:p@host/x?X-Amz-Signature=s&X-Amz-Credential=c&sig=z&region=eu",
            "https://host/x?X-Amz-Signature=***&X-Amz-Credential=***&sig=***&region=eu",
        ),
        ("s3://bucket/run@v2/x", "s3://bucket/run@v2/x"),
        ("file:///tmp/store", "file:///tmp/store"),
    ],
)
def test_urls_lose_their_credentials_whatever_characters_they_hold(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_command_lines_lose_the_values_of_secret_options() -> None:
    argv = ["python", "t.py", "--hf-token=abc", "--api-key", "K", "--lr", "0.1", "--keep", "3",
            "HF_TOKEN=x", "--password", "p", "--author", "me", "s3://A:B/C@b/p", "--token"]  # fmt: skip
    assert redact_argv(argv) == [
        "python", "t.py", "--hf-token=***", "--api-key", "***", "--lr", "0.1", "--keep", "3",
        "HF_TOKEN=***", "--password", "***", "--author", "me", "s3://b/p", "--token",
    ]  # fmt: skip
