"""The generated sections of README.md and docs/benchmarks.md: one function per section, named
in :data:`SECTIONS`, building its lines from result files through ``render_docs.Section`` (every
figure read from a file; the renderer names the files under the section).

Standard library only, like render_docs.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["SECTIONS"]

SECTIONS: dict[str, Callable[[Any], list[str]]] = {}
