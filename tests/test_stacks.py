"""The stacks people fine-tune with, under ``smartckpt run``: real libraries, real ranks (torchrun,
or Lightning's own launcher), one rank SIGKILLed mid-run, and the final state of every rank
compared bit for bit with an uninterrupted run of the same command.

Each case asserts what a user would check: the run finished after one restart; checkpoints were
committed (by every rank: a commit names one part per rank); the restarted attempt began past
step 0 from a checkpoint (``restored_from``); its resume check says ``exact`` (or ``unchecked``,
with why); the first attempt's cause names the rank that was killed, not a peer that lost its
connection; and every rank's final weights equal the uninterrupted run's.

The matrix here is what CI runs (each stack with and without smartckpt code, on several ranks,
DDP and FSDP2 on three). ``SMARTCKPT_STACKS_FULL=1`` runs every stack and mode at 1, 2 and 3
ranks (the README's table was filled from that run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]


@dataclass(frozen=True)
class Stack:
    script: str
    args: tuple[str, ...]  # both runs
    kill_at: int  # the killed run's --kill-at
    final: str = "--final"  # the flag that names each rank's final-state file (--out: it alone)
    lightning: bool = False  # Lightning starts its own ranks (--devices N), no torchrun
    needs: tuple[str, ...] = ()  # importable packages
    ranks: tuple[int, ...] = (2,)  # in CI
    env: dict[str, str] = field(default_factory=dict)


HF = ("--max-steps", "12")
STACKS: dict[str, Stack] = {
    "hf-trainer-zero-code": Stack("hf_train.py", HF, 8, needs=("transformers",)),
    "hf-trainer-callback": Stack("hf_train.py", (*HF, "--callback"), 8, needs=("transformers",)),
    "hf-trainer-grad-accum": Stack("hf_train.py", (*HF, "--grad-accum", "2"), 8, needs=("transformers",)),
    "hf-peft-lora-minilm": Stack(
        "hf_train.py", (*HF, "--model", "minilm", "--lora"), 8, needs=("transformers", "peft")
    ),
    "trl-sft-minilm": Stack("trl_train.py", HF, 8, needs=("trl",)),
    "accelerate-zero-code": Stack(
        "accelerate_train.py", ("--total", "16"), 9, final="--out", needs=("accelerate",)
    ),
    "accelerate-api": Stack(
        "accelerate_train.py", ("--total", "16", "--api"), 9, final="--out", needs=("accelerate",)
    ),
    "lightning-ddp-zero-code": Stack(
        "lightning_train.py", ("--max-steps", "12"), 8, lightning=True, needs=("pytorch_lightning",)
    ),
    "lightning-ddp-callback-plain-loader": Stack(
        "lightning_train.py",
        ("--max-steps", "12", "--callback", "--plain-loader"),
        8,
        lightning=True,
        needs=("pytorch_lightning",),
    ),
    "ddp-inner-module-loader-api": Stack(
        "ddp_train.py", ("--total", "30", "--register-inner", "--loader"), 13, final="--out", ranks=(3,)
    ),
    "ddp-zero-code": Stack("ddp_train.py", ("--total", "30", "--zero-code"), 13, final="--out", ranks=(3,)),
    "fsdp2-loader-api": Stack(
        "ddp_train.py", ("--total", "30", "--mode", "fsdp", "--loader"), 13, final="--out", ranks=(3,)
    ),
    "fsdp2-zero-code": Stack(
        "ddp_train.py", ("--total", "30", "--mode", "fsdp", "--zero-code"), 13, final="--out", ranks=(3,)
    ),
}

FULL = os.environ.get("SMARTCKPT_STACKS_FULL") == "1"
CASES = [(name, n) for name, st in STACKS.items() for n in ((1, 2, 3) if FULL else st.ranks)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        SMARTCKPT_RESTART_BACKOFF="0.1",
    )
    return env


def _command(st: Stack, n: int, final: str, extra: list[str]) -> list[str]:
    """The command of one run; each rank writes ``<final>.r<rank>``."""
    args = [*st.args, st.final, final, *extra]
    if st.final == "--final":  # these scripts also need a folder of their own (--out)
        args += ["--out", f"{final}-out"]
    if st.lightning:
        return [sys.executable, str(SCRIPTS / st.script), *args, "--devices", str(n)]
    return [*TORCHRUN, str(n), str(SCRIPTS / st.script), *args]


def _finals(d: Path, prefix: str, n: int) -> list[Any]:
    return [torch.load(d / f"{prefix}.r{r}", weights_only=True) for r in range(n)]


def _flat(x: Any, path: str = "") -> dict[str, Any]:
    if isinstance(x, dict):
        out: dict[str, Any] = {}
        for k, v in x.items():
            out.update(_flat(v, f"{path}/{k}"))
        return out
    return {path: x}


def _same(a: Any, b: Any) -> list[str]:
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    return [
        k
        for k in fb
        if not (torch.equal(fa[k], fb[k]) if isinstance(fb[k], torch.Tensor) else fa[k] == fb[k])
    ]


@pytest.mark.parametrize(("name", "n"), CASES, ids=[f"{name}-{n}rank" for name, n in CASES])
def test_a_stack_killed_on_one_rank_resumes_bit_exact(tmp_path: Path, name: str, n: int) -> None:
    st = STACKS[name]
    for mod in st.needs:
        pytest.importorskip(mod)
    env = {**_env(), **st.env}
    kill_rank = n - 1  # the last rank: not the one that writes the journal
    ref = subprocess.run(
        _command(st, n, "ref", []), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400
    )
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    killed = ["--kill-at", str(st.kill_at), "--kill-rank", str(kill_rank)]
    run = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "--every", "5", "--",
         *_command(st, n, "fin", killed)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    (path,) = (tmp_path / "ck" / "runs").glob("*.json")
    rec = json.loads(path.read_text())
    assert rec["outcome"] == "finished" and rec["restarts"] == 1, rec
    first, second = rec["attempts"]
    if not st.lightning:  # torchrun's report names the rank and its signal
        assert first["cause"] == f"rank {kill_rank} killed by SIGKILL", first
    elif n > 1:  # Lightning's ranks: the one whose heartbeat stopped without a word
        assert first["cause"].startswith(f"rank {kill_rank} ended without an error of its own"), first
    else:  # one process, killed itself
        assert first["cause"] == "killed by SIGKILL", first
    assert "peer" not in first["cause"] and "communication" not in first["cause"]
    commits = [
        e for e in map(json.loads, (tmp_path / "ck" / "journal.jsonl").read_text().splitlines())
        if e["event"] == "commit"
    ]  # fmt: skip
    assert commits and all(e.get("world_size", 1) == n for e in commits), commits
    assert second["start_step"] > 0 and second["restored_from"] in ("ram", "disk"), second
    assert second["start_step"] == first["restart_from"]
    check = second["resume_check"]
    assert check is not None and check["step"] == second["start_step"] + 1, second
    assert check["verdict"] == "exact" or (check["verdict"] == "unchecked" and check["why"]), check
    differ = {
        r: _same(a, b)
        for r, (a, b) in enumerate(zip(_finals(tmp_path, "fin", n), _finals(tmp_path, "ref", n), strict=True))
    }
    assert not any(differ.values()), (
        f"entries that differ from the uninterrupted run: {differ}\n{out[-4000:]}"
    )
