"""Reading what a timeline is built from, out of a store: the only I/O of the timeline.

- the journal (every event, in order; read under its shared lock, as ``inspect`` does, so a
  line being appended by a running job is never taken for damage);
- the trace files, ``<meta_dir>/traces/*.csv`` (a file there that is not a trace is skipped
  with a warning: one stray file must not hide the run);
- the run records, ``<dir>/runs/*.json``;
- the manifests of the *live* checkpoints only, for their UTC second (a handful of files; the
  pruned ones are gone anyway, see :mod:`~smartckpt_cli.timeline.place`);
- ``<meta_dir>/remote-status.json``, the remote uploader's last word on the upload lag.

No torch, no matplotlib: this runs in the control plane.
"""

from __future__ import annotations

import calendar
import logging
import os
import time
from pathlib import Path

from smartckpt_cli.errors import CheckpointCorrupt, ConfigError
from smartckpt_cli.remote.check import read_status
from smartckpt_cli.store.checkpoints import read_manifest
from smartckpt_cli.store.directory import open_store
from smartckpt_cli.supervise.records import read_records
from smartckpt_cli.timeline.build import StoreFacts
from smartckpt_cli.timeline.tracetable import TraceTable, read_table

__all__ = ["load_store"]

logger = logging.getLogger(__name__)


def _utc(text: object) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return float(calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None


def load_store(
    directory: str | os.PathLike[str], meta_dir: str | os.PathLike[str] | None = None
) -> StoreFacts:
    store = open_store(directory, meta_dir)  # not a store / missing: one line, exit 2
    state, events = store.journal.read_events(consistent=True)
    tables: list[TraceTable] = []
    for path in sorted((store.meta_root / "traces").glob("*.csv")):
        try:
            tables.append(read_table(path))
        except (ConfigError, OSError) as err:
            logger.warning("%s", err)
    utc: dict[str, float] = {}
    for rec in state.live():
        try:
            meta = read_manifest(store.storage, rec, state.store_id).get("meta", {})
        except (CheckpointCorrupt, OSError):
            continue  # placed from the traces instead
        t = _utc(meta.get("utc"))
        if t is not None:
            utc[rec.id] = t
    return StoreFacts(
        store=str(Path(directory)),
        tables=tables,
        events=events,
        runs=read_records(store.root),
        manifest_utc=utc,
        remote=read_status(store.meta_root),
    )
