"""``smartckpt verify``: re-hash and decode checkpoints; exit 1 naming each corrupt one."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from smartckpt_cli.cli._shared import (
    DirArg,
    MetaDirOpt,
    RemoteOpt,
    human,
    open_checkpoints,
    progress_bar,
    say,
)

__all__ = ["verify"]


def verify(
    directory: DirArg,
    step: Annotated[int | None, typer.Option("--step", help="Verify the checkpoint(s) of this step.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Verify every live checkpoint.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    workers: Annotated[
        int, typer.Option("--workers", min=0, help="Hashing threads (0: one per CPU, at least 4).")
    ] = 0,
    record: Annotated[
        bool,
        typer.Option("--record/--no-record", help="Note the outcome in the journal, for inspect."),
    ] = True,
    meta_dir: MetaDirOpt = None,
    remote: RemoteOpt = None,
) -> None:
    """Re-hash and decode checkpoints; exit 1 naming each corrupt one.

    Checks the newest live checkpoint (or --step N, or --all live ones): every blob is re-hashed
    and every chunk decoded, the manifests are checked against their commits, and the journal
    for torn or damaged lines.

    Prints one line per checkpoint: 'ok', or 'CORRUPT:' and what is wrong (missing blob, hash
    mismatch, undecodable chunk, a manifest that does not match its commit), plus one line per
    torn or damaged journal line. A progress bar is shown on a terminal.

    A checkpoint of several ranks is checked part by part: every rank's part this directory
    holds (all of them on a shared dir). Parts written to another node's disk (node-local dirs)
    are named on the line as not checked here; verify that node's directory too.

    \b
    Examples:
      smartckpt verify ./checkpoints
      smartckpt verify ./checkpoints --all --json
      smartckpt verify ./checkpoints --step 1200 || echo "step 1200 is damaged"
      smartckpt verify ./checkpoints --remote s3://bucket/run1 --all

    With --remote, the same checkpoints (newest, --step or --all) are checked on the remote
    side too: its commit, its manifest and every blob downloaded and re-hashed; one line each,
    prefixed 'remote'.

    \b
    Exit codes:
      0  every checked checkpoint is sound (or there is none)
      1  a checkpoint is corrupt (locally or remotely), the journal has a torn/damaged
         line, the remote is unreachable, or DIR holds run records of smartckpt run
         but no checkpoint
      2  bad input: not a store, no such step, --step with --all
    """
    from smartckpt_cli.errors import UsageError
    from smartckpt_cli.ops.verify import record_results
    from smartckpt_cli.ops.verify import verify as run_verify

    if step is not None and all_:
        raise UsageError("--step and --all exclude each other")
    store = open_checkpoints(directory, meta_dir)
    with progress_bar("verifying") as progress:
        report = run_verify(store, step=step, all_checkpoints=all_, workers=workers, progress=progress)
    if record:
        record_results(store, report)
    remote_results = None
    if remote is not None:
        from smartckpt_cli.remote.check import connect, verify_remote

        rem, _, rstate = connect(remote)
        remote_results = verify_remote(rem, rstate, step=step, all_checkpoints=all_, workers=max(workers, 4))
    remote_ok = remote_results is None or all(r.ok for r in remote_results)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "ok": report.ok,
                    "results": [
                        {k: v for k, v in r.__dict__.items() if k != "problem"} for r in report.results
                    ],
                    "journal_problems": report.journal_problems,
                    "bytes_checked": report.bytes_checked,
                    "seconds": round(report.seconds, 3),
                    "remote": None if remote_results is None else [r.__dict__ for r in remote_results],
                },
                indent=2,
            )
        )
    else:
        for r in report.results:
            # Plain lines, never wrapped: operators grep them for blob ids.
            state = r.note if r.note else "ok" if r.ok else f"CORRUPT: {r.problem}"
            say(f"step {r.step} ({r.id}): {state}{_parts_said(r.ranks_checked, r.ranks_elsewhere)}")
        for p in report.journal_problems:
            say(f"journal: {p}")
        for rr in remote_results or []:
            say(f"remote step {rr.step} ({rr.id}): " + ("ok" if rr.ok else f"CORRUPT: {rr.problem}"))
        if remote_results == []:
            say("remote: no checkpoint to verify")
        if not report.results:
            say("no checkpoint to verify")
        elif report.seconds > 0 and sys.stderr.isatty():
            rate = report.bytes_checked / report.seconds
            say(
                f"checked {human(report.bytes_checked)} in {report.seconds:.2f} s ({human(rate)}/s)",
                error=True,
            )
    raise typer.Exit(0 if report.ok and remote_ok else 1)


def _parts_said(checked: list[int], elsewhere: list[int]) -> str:
    """What of a multi-rank checkpoint was checked from this directory ('' for one process)."""
    if not elsewhere:
        return f" ({len(checked)} ranks' parts)" if len(checked) > 1 else ""
    ranks = ", ".join(map(str, elsewhere))
    mine = ", ".join(map(str, checked)) or "none"
    return (
        f" (parts checked here: rank {mine}; rank {ranks} wrote to another disk: "
        "verify that node's directory with the same --meta-dir)"
    )
