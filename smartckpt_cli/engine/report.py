"""What this process tells ``smartckpt run`` beyond its heartbeat: ``<run_dir>/report.<pid>.json``
(the contract, and the list of facts, is ``hooks/_smartckpt_protocol.py``'s ``REPORT_FACTS``).

The facts only the training process knows: the step the script really began at and where it
was restored from (``start_step``, ``restored_from``, ``checkpoint``, ``lineage``), whether the
script called ``start_step()`` (and whether too early), the resume check's verdict, a training
whose backward passes no ``torch.optim`` optimizer ever follows (``no_optimizer``). The
supervisor prints and records them; it never guesses them from the store.

The file is rewritten whole (tmp + rename) when a fact is added: a handful of times per process,
never on a step's path. Outside ``smartckpt run`` (no ``SMARTCKPT_RUN_DIR``) nothing is written.
A leaf, like :mod:`.heartbeat`: the engine and the agent both report through it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from smartckpt_cli.engine.heartbeat import protocol, run_dir

__all__ = ["note", "report", "reported"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_facts: dict[str, Any] = {}
_pid = -1


def report(**facts: Any) -> None:
    """Add ``facts`` to this process's report (a later value replaces an earlier one) and rewrite
    the file; nothing outside ``smartckpt run``. Never raises: a report that cannot be written
    must not stop training."""
    global _facts, _pid
    facts = _known(facts)
    with _lock:
        if _pid != os.getpid():  # a forked child reports for itself
            _facts, _pid = {}, os.getpid()
        _facts.update(facts)
        where = run_dir()
        if where is None:
            return
        payload = {"pid": _pid, "rank": int(os.environ.get("RANK", "-1") or -1), **_facts}
        try:
            proto = protocol()
            proto.write_json(proto.report_path(where, _pid), payload)
        except (OSError, TypeError, ValueError) as err:
            logger.debug("report not written: %s", err)


def note(**facts: Any) -> None:
    """Add ``facts`` to what the next :func:`report` writes, writing nothing now: a process that
    never reports (the torchrun agent, a DataLoader worker) leaves no file for them."""
    global _facts, _pid
    facts = _known(facts)
    with _lock:
        if _pid != os.getpid():
            _facts, _pid = {}, os.getpid()
        _facts.update(facts)


def reported() -> dict[str, Any]:
    """What this process has reported so far (also outside ``smartckpt run``)."""
    with _lock:
        return dict(_facts) if _pid == os.getpid() else {}


def _known(facts: dict[str, Any]) -> dict[str, Any]:
    """``facts`` without a name the protocol does not list (``REPORT_FACTS``): a fact the
    supervisor cannot know is a mistake here, said, never written (tests/test_child_protocol.py
    finds every name this package reports)."""
    names = protocol().REPORT_FACTS
    unknown = sorted(k for k in facts if k not in names)
    if unknown:
        logger.warning("smartckpt: not in the report protocol, not reported: %s", ", ".join(unknown))
        return {k: v for k, v in facts.items() if k in names}
    return facts
