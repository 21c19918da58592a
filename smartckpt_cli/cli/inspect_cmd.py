"""``smartckpt inspect`` (alias ``ls``): the checkpoints of a store, or one manifest in detail."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer

from smartckpt_cli.cli._shared import (
    MetaDirOpt,
    RemoteOpt,
    StoreArg,
    fitted_table,
    human,
    open_checkpoints,
    out,
    say,
)
from smartckpt_cli.cli.fit import Column, table_width

if TYPE_CHECKING:
    from rich.console import Console

    from smartckpt_cli.ops.catalog import Catalog, Row
    from smartckpt_cli.ops.detail import EntryRow, ManifestDetail

__all__ = ["inspect"]


def inspect(
    directory: StoreArg,
    step: Annotated[
        int | None, typer.Option("--step", help="Show this checkpoint's manifest, tensor by tensor.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    meta_dir: MetaDirOpt = None,
    remote: RemoteOpt = None,
) -> None:
    """List the checkpoints of a store, newest first (alias: ls).

    One row per checkpoint: step, UTC time, trigger reason and score, health, the ranks that
    wrote it and how its tensors are sharded (2 S0×12: two ranks, 12 DTensors as Shard(0)),
    tiers, optimizer precision, bytes on disk that only it holds vs bytes shared with other
    checkpoints, its last verification, and whether it is live, rolled back or pruned. '>' marks
    what a resume loads.

    \b
    Examples:
      smartckpt inspect ./checkpoints
      smartckpt ls ./checkpoints --step 1200   (one manifest, tensor by tensor)
      smartckpt inspect ./checkpoints --json | jq '.checkpoints[0].step'
      smartckpt inspect ./checkpoints --remote s3://bucket/run1     (upload lag)

    With a remote tier, a last line tells how many committed checkpoints are not remote yet
    (from the uploader's status file, or from the remote itself with --remote).

    A run that began again at step 0 (a script that does not call start_step()) starts a new
    lineage: its checkpoints are not the continuation of the ones before it. With more than one
    lineage, a 'line' column gives each checkpoint's (A, B, ... in the order they began) and a
    line below says what each is; a resume never falls back from one lineage into another.
    Every resume's check (the first resumed step's loss against the interrupted run's: exact,
    close or differs) is listed below the table.

    A journal that lost lines (emptied, overwritten, damaged in the middle) leaves manifests no
    line names: one line says how many and which steps, and how to put them back (smartckpt
    verify --repair). '>' marks what a resume loads: the newest live checkpoint not known to be
    damaged (its manifest reads, its blobs are there at their size, its last verify passed).

    Exit codes: 0 listed, 1 the journal cannot be read or lost checkpoints (manifests no line
    names), or a directory with run records of smartckpt run but no checkpoint, 2 bad input
    (not a store, no such step).
    """
    from smartckpt_cli.ops.catalog import list_checkpoints
    from smartckpt_cli.ops.detail import describe

    store = open_checkpoints(directory, meta_dir)
    if step is not None:
        _show_detail(describe(store, step), as_json)
        return
    catalog = list_checkpoints(store)
    remote_view = _remote_view(store, remote)
    if as_json:
        typer.echo(json.dumps({**catalog.to_json(), "remote": remote_view}, indent=2))
        return
    _render_catalog(directory, catalog, remote_view)


def _render_catalog(directory: str, catalog: Catalog, remote_view: dict[str, object] | None) -> None:
    """The table, then one line per thing an operator should know: lineages, resume checks,
    journal problems, failures, the remote's lag, damage; exit 1 for checkpoints the journal lost."""
    _print_table(directory, catalog)
    if not catalog.rows and not catalog.unjournalled:
        say("no checkpoint committed yet")
    if len(catalog.lineages) > 1:
        _say_lineages(catalog)
    for c in catalog.resume_checks:
        say(_check_line(c, catalog))
    _say_troubles(catalog)
    if remote_view is not None:
        say(_remote_line(remote_view))
    damaged = [r for r in catalog.rows if r.manifest_problem and r.state != "pruned"]
    for r in damaged:
        say(f"step {r.step} ({r.id}) is damaged: {r.manifest_problem}", error=True)
    if damaged and not any(r.restore_target for r in catalog.rows):
        say("no live checkpoint is known sound: a resume would begin at step 0", error=True)
    for line in catalog.unjournalled:
        say(line, error=True)
    if catalog.unjournalled:
        raise typer.Exit(1)  # checkpoints the journal lost: not a sound store


def _print_table(directory: str, catalog: Catalog) -> None:
    console = out()
    several = len(catalog.lineages) > 1
    columns = [
        Column(""),
        *((Column("line"),) if several else ()),
        Column("step", "right"),
        Column("time (UTC)", drop=3),
        Column("reason", drop=4),
        Column("health", drop=1),
        Column("ranks", drop=6),
        Column("tiers", drop=8),
        Column("precision", drop=10),
        Column("unique", "right", drop=5),
        Column("shared", "right", drop=7),
        Column("verified", drop=2),
        Column("blobs checked", drop=9),
        Column("state", drop=1),
    ]
    # On a narrow terminal the time loses its year and seconds before a column is left out.
    full = [_row_cells(r, several, short_time=False) for r in catalog.rows]
    cells = (
        full
        if table_width(columns, full, range(len(columns))) <= console.width
        else [_row_cells(r, several, short_time=True) for r in catalog.rows]
    )
    table, left_out = fitted_table(f"checkpoints in {directory}", columns, cells, console)
    console.print(table)
    if left_out:
        say(left_out)


def _row_cells(r: Row, several: bool, *, short_time: bool) -> list[str]:
    """One checkpoint's cells; ``several``: with the lineage column."""
    reason = r.reason + (f" {r.score:.2f}" if isinstance(r.score, int | float) else "")
    on_disk = r.state != "pruned" and r.manifest_problem is None
    utc = (r.utc or "-").replace("T", " ").rstrip("Z")
    return [
        ">" if r.restore_target else "",
        *((r.line,) if several else ()),
        str(r.step),
        utc[5:16] if short_time and r.utc else utc,
        reason or "-",
        r.health if r.manifest_problem is None else "DAMAGED",
        str(r.world_size) + (f" {r.sharding}" if on_disk and r.sharded else ""),
        "+".join(r.tiers) if on_disk else "-",
        r.precision if on_disk else "-",
        human(r.bytes_unique) if on_disk else "-",
        human(r.bytes_shared) if on_disk else "-",
        {"ok": "ok", "corrupt": "CORRUPT", "never": "-"}[r.verified],
        _checked_cell(r.blobs_checked_utc, r.blobs_checked_how) if on_disk else "-",
        r.state,
    ]


def _say_lineages(catalog: Catalog) -> None:
    newest = max(catalog.rows, key=lambda r: r.restore_target).line if catalog.rows else "?"
    for ln in catalog.lineages:
        say(
            f"lineage {ln.line}: {ln.checkpoints} checkpoint(s), steps {ln.first_step}..{ln.last_step}"
            + (" (a resume loads this one)" if ln.line == newest else "")
        )
    say(
        "each lineage is a training that began at step 0 (a restart of a script that does not call "
        "start_step() begins again); a resume never falls back from one lineage into another"
    )


def _say_troubles(catalog: Catalog) -> None:
    """What the journal says went wrong while the store was written, on stderr."""
    for p in catalog.journal_problems:
        say(f"warning: journal: {p}", error=True)
    if catalog.failures:
        last = catalog.failures[-1]
        say(f"{len(catalog.failures)} failed save(s); last: {last.get('error', '?')}", error=True)
    for off in catalog.checkpointing_off:
        say(
            f"zero-code checkpointing turned itself off at step {off.get('step')} ({off.get('utc', '?')}): "
            f"{off.get('why', '?')}; that run trained on without checkpoints",
            error=True,
        )
    for io in catalog.io_errors:
        say(f"writing the {io.get('what')} failed ({io.get('utc', '?')}): {io.get('error', '?')}", error=True)


def _checked_cell(utc: str | None, how: str | None) -> str:
    """The oldest blob check as ``12-06 01:57`` (``written`` when never re-hashed since)."""
    if utc is None:
        return "-"
    short = utc[5:16].replace("T", " ")
    return short if how == "checked" else f"{short} written"


def _check_line(c: dict[str, object], catalog: object) -> str:
    """One resume check of the journal, in words."""
    from smartckpt_cli.ops.catalog import Catalog

    assert isinstance(catalog, Catalog)
    row = next((r for r in catalog.rows if r.id == c.get("id")), None)
    frm = f"step {row.step}" if row is not None else f"checkpoint {c.get('id')}"
    exp, got = c.get("expected") or {}, c.get("got") or {}
    loss = ""
    if isinstance(exp, dict) and isinstance(got, dict) and exp.get("loss") is not None:
        loss = f" (loss {got.get('loss')} vs {exp.get('loss')})"
    return f"resumed from {frm}: resume check at step {c.get('step')}: {c.get('verdict')}{loss}"


def _remote_view(store: object, url: str | None) -> dict[str, object] | None:
    """The remote tier's side: asked of the remote (--remote), else the uploader's status file."""
    from smartckpt_cli.remote.check import read_status, remote_summary
    from smartckpt_cli.store.directory import StoreDir

    assert isinstance(store, StoreDir)
    if url is None:
        return None if store.url is not None else read_status(store.meta_root)
    state = store.journal.read()
    return remote_summary(state.records, state.store_id, url)


def _remote_line(v: dict[str, object]) -> str:
    pending = v.get("pending_steps") or []
    line = f"remote {v.get('remote')}: {v.get('pending', 0)} committed checkpoint(s) not yet remote"
    line += f" (steps {', '.join(map(str, pending))})" if pending else ""  # type: ignore[call-overload]
    steps = v.get("live_steps", v.get("remote_steps")) or []
    line += f"; remote holds steps {', '.join(map(str, steps))}" if steps else "; remote holds none"  # type: ignore[call-overload]
    ranks = v.get("ranks")
    if isinstance(ranks, list) and ranks:
        cells = [
            f"rank {x.get('rank')} {x.get('pending') if x.get('pending') is not None else '?'} behind"
            + (f" ({float(x['lag_seconds']):.0f}s)" if x.get("lag_seconds") else "")
            for x in ranks
            if isinstance(x, dict)
        ]
        line += "; per rank: " + ", ".join(cells)
        if "slowest_rank" in v:
            line += f"; slowest rank {v['slowest_rank']}"
    if v.get("same_store") is False:
        line += "; WARNING: the remote holds another store's checkpoints"
    if v.get("last_error"):
        line += f"; last upload error: {v['last_error']}"
    if v.get("disabled"):
        line += f"; replication disabled: {v['disabled']}"
    return line


def _show_detail(detail: ManifestDetail, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(detail.to_json(), indent=2))
        return
    _render_detail(detail)


def _render_detail(detail: object) -> None:
    from smartckpt_cli.ops.detail import ManifestDetail

    assert isinstance(detail, ManifestDetail)
    console = out()
    _print_detail_head(detail, console)
    columns = [
        Column("tensor", fold=True),
        Column("tier", drop=5),
        Column("dtype", drop=3),
        Column("shape", drop=1),
        Column("stored as", drop=6),
        Column("chunks", "right", drop=7),
        Column("raw", "right", drop=4),
        Column("on disk", "right", drop=2),
    ]
    cells = [_entry_cells(e) for e in detail.entries]
    table, left_out = fitted_table(None, columns, cells, console)
    console.print(table)
    if left_out:
        console.print(left_out, markup=False)
    if detail.not_stored:
        console.print(f"not stored (L4): {', '.join(detail.not_stored)}", markup=False)


def _print_detail_head(detail: ManifestDetail, console: Console) -> None:
    """The lines above the tensors: the checkpoint, its bytes and checks, objects, sharding, host."""
    r = detail.row
    console.print(
        f"step {r.step} ({r.id}), {r.state}, health {r.health}, saved {r.utc or '?'}, reason "
        f"{r.reason or '-'}" + (f" (score {r.score:.3f})" if isinstance(r.score, int | float) else ""),
        markup=False,
    )
    console.print(
        f"manifest {detail.manifest_path}; {human(r.bytes_total)} on disk"
        + (" (rank 0's part)" if r.world_size > 1 else "")
        + f", {human(r.bytes_unique)} "
        f"unique, {human(r.bytes_shared)} shared; verified: {r.verified}"
        + (f" ({r.verified_utc})" if r.verified_utc else "")
        + (
            f"; oldest blob check {r.blobs_checked_utc}"
            + (" (when written; never re-hashed since)" if r.blobs_checked_how == "written" else "")
            if r.blobs_checked_utc
            else ""
        ),
        markup=False,
    )
    console.print("objects: " + ", ".join(f"{n} ({k})" for n, k in detail.objects.items()), markup=False)
    sharding = detail.sharding_line()
    if sharding is not None:
        console.print(sharding, markup=False)
    versions = detail.meta.get("versions") or {}
    if versions or detail.meta.get("host"):
        console.print(
            f"host {detail.meta.get('host', '?')}, world size {detail.meta.get('world_size', '?')}, "
            f"git {detail.meta.get('git_commit') or '-'}, "
            + ", ".join(f"{k} {v}" for k, v in versions.items()),
            markup=False,
        )


def _entry_cells(e: EntryRow) -> list[str]:
    stored = e.stored_dtype + ("" if e.transform == "none" else f" ({e.transform})")
    if e.patched:
        stored += f" +{e.patched} exact"
    return [
        e.key,
        e.tier,
        e.dtype,
        _shape(e.shape) + (f" of {_shape(e.global_shape)}" if e.global_shape is not None else ""),
        stored,
        str(e.chunks),
        human(e.bytes_raw),
        human(e.bytes_stored),
    ]


def _shape(shape: list[int]) -> str:
    return "x".join(map(str, shape)) or "scalar"
