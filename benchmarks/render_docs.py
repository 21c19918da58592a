"""Rewrite the generated sections of README.md and docs/benchmarks.md from the result files in
benchmarks/results/ (the format is in docs/benchmarks.md, "Result files").

    python benchmarks/render_docs.py            # rewrite every generated section
    python benchmarks/render_docs.py --check    # exit 1, naming each section that is out of date

A generated section lies between two markers, each on a line of its own:

    <!-- figures:NAME -->
    ...
    <!-- /figures:NAME -->

NAME is a function in ``sections.py`` (beside this file) that builds the section's lines from the
result files, through :class:`Section`: every figure it shows is read from a file, and every file
it reads is named under the section with its command, commit, date and machine. A figure a
section asks for that no file holds, a result file without a command, and a section name no
function renders are errors (``tests/test_bench_docs.py`` runs ``--check``).

Standard library only: it needs neither torch nor smartckpt.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "DOCUMENTS",
    "ResultError",
    "Results",
    "Section",
    "check_result",
    "render_all",
    "render_document",
]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCUMENTS = ("README.md", "docs/benchmarks.md")
FORMAT, VERSION = "smartckpt-bench-result", 1
UNITS = {"s", "ms", "us", "x", "%", "B", "MB", "GB", "MB/s", "GB/s", "steps/s", "steps", "count", "num"}
_MARK = re.compile(r"^<!-- (/?)figures:([A-Za-z0-9_.-]+) -->$")
_SCALE = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "B": 1.0, "MB": 1e6, "GB": 1e9, "MB/s": 1e6, "GB/s": 1e9}
_KIND = {"s": "time", "ms": "time", "us": "time", "B": "size", "MB": "size", "GB": "size"}
_KIND.update({"MB/s": "rate", "GB/s": "rate"})


class ResultError(Exception):
    """A result file that is missing or malformed, a figure it lacks, a section nobody renders."""


def check_result(data: Any, committed: bool = True) -> list[str]:
    """What is wrong with one result file's content (empty: nothing). ``committed``: a file the
    documents may cite, which must name the commit it measured and no uncommitted code."""
    if not isinstance(data, dict):
        return ["not a JSON object"]
    problems = []
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        problems.append(f"not a {FORMAT} version {VERSION} file")
    for key in ("benchmark", "command", "date"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            problems.append(f"no {key}")
    if committed and (
        not isinstance(data.get("commit"), str) or not re.fullmatch(r"[0-9a-f]{40}", data["commit"])
    ):
        problems.append("no commit (a 40-digit git hash)")
    if committed and data.get("dirty") is not False:
        problems.append("measured with uncommitted changes to the code (dirty is not false)")
    device = data.get("device")
    if not isinstance(device, dict) or not device.get("type") or not device.get("name"):
        problems.append("no device (type and name)")
    mach = data.get("machine")
    if not isinstance(mach, dict) or not isinstance(mach.get("cpus"), int) or not mach.get("memory_bytes"):
        problems.append("no machine (cpus and memory_bytes)")
    if "torch" not in data:
        problems.append("no torch version (null for a benchmark without torch)")
    figures = data.get("figures")
    if not isinstance(figures, dict) or not figures:
        problems.append("no figures")
        return problems
    for key, fig in figures.items():
        if not isinstance(fig, dict):
            problems.append(f"figure {key}: not an object")
            continue
        value = fig.get("value")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            problems.append(f"figure {key}: no finite value")
        if fig.get("unit") not in UNITS:
            problems.append(f"figure {key}: unit {fig.get('unit')!r} is not one of {sorted(UNITS)}")
        if not isinstance(fig.get("what"), str) or not fig["what"].strip():
            problems.append(f"figure {key}: no description (what)")
    return problems


class Results:
    """The result files of one folder, by name (the file name without ``.json``), checked as
    they are read."""

    def __init__(self, folder: Path = RESULTS) -> None:
        self.folder = folder
        self._cache: dict[str, dict[str, Any]] = {}

    def names(self) -> list[str]:
        return sorted(p.stem for p in self.folder.glob("*.json"))

    def get(self, name: str) -> dict[str, Any]:
        if name not in self._cache:
            path = self.folder / f"{name}.json"
            rel = _rel(path)
            try:
                data = json.loads(path.read_text())
            except FileNotFoundError:
                raise ResultError(f"no result file {rel}") from None
            except (OSError, ValueError) as err:
                raise ResultError(f"{rel}: unreadable ({err})") from None
            problems = check_result(data)
            if problems:
                raise ResultError(f"{rel}: " + "; ".join(problems))
            self._cache[name] = data
        return self._cache[name]


def _rel(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


class Section:
    """What a section function reads figures through: it remembers every result file used, to
    name them under the section."""

    def __init__(self, results: Results) -> None:
        self.results = results
        self.used: list[str] = []

    def data(self, name: str) -> dict[str, Any]:
        data = self.results.get(name)
        if name not in self.used:
            self.used.append(name)
        return data

    def has(self, name: str, key: str | None = None) -> bool:
        """Whether the result file (and the figure) exists; reads nothing into the section."""
        try:
            data = self.results.get(name)
        except ResultError:
            return False
        return key is None or key in data["figures"]

    def value(self, name: str, key: str, unit: str | None = None) -> float:
        """The figure's value, converted to ``unit`` (time, size and rate units convert)."""
        fig = self.data(name)["figures"].get(key)
        if fig is None:
            raise ResultError(f"{_rel(self.results.folder / name)}.json has no figure {key!r}")
        value, have = float(fig["value"]), fig["unit"]
        if unit is None or unit == have:
            return value
        if _KIND.get(unit) is None or _KIND.get(unit) != _KIND.get(have):
            raise ResultError(f"figure {key!r} of {name}: {have} does not convert to {unit}")
        return value * _SCALE[have] / _SCALE[unit]

    def fig(self, name: str, key: str, fmt: str | None = None, unit: str | None = None) -> str:
        """The figure as text with its unit: ``0.983×``, ``12.3 ms``, ``+0.9 %``, ``1.21 GB``."""
        shown = unit or self.data(name)["figures"].get(key, {}).get("unit")
        value = self.value(name, key, unit)
        text = fmt.format(value) if fmt else _number(value)
        if shown == "x":
            return f"{text}×"
        if shown in ("count", "num"):
            return text
        return f"{text} {'µs' if shown == 'us' else shown}"

    def details(self, name: str) -> dict[str, Any]:
        return dict(self.data(name).get("details") or {})

    def sources(self) -> list[str]:
        """One line per result file used: its command, commit, date and machine."""
        out = []
        for name in self.used:
            d = self.results.get(name)
            m, dev = d["machine"], d["device"]
            gb = m["memory_bytes"] / 1e9
            device = dev["name"] if dev["name"] != dev["type"] else m.get("cpu_model", dev["name"])
            where = f"{dev['type']}: {device}" if dev["type"] != "cpu" else device
            out.append(
                f"`{d['command']}` — commit {d['commit'][:10]}, {d['date'][:10]}, {where}, "
                f"{m['cpus']} CPUs, {gb:.0f} GB, torch {d['torch'] or '-'} "
                f"([{name}.json](/benchmarks/results/{name}.json))"
            )
        return out


def _number(v: float) -> str:
    a = abs(v)
    if float(v).is_integer() and a < 1e15:
        return f"{int(v):,}" if a >= 10_000 else str(int(v))
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def _sections() -> dict[str, Callable[[Section], list[str]]]:
    spec = importlib.util.spec_from_file_location("_bench_sections", Path(__file__).with_name("sections.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.SECTIONS)


def render_document(text: str, results: Results, where: str = "") -> str:
    """``text`` with every generated section rebuilt from ``results``."""
    sections = _sections()
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _MARK.match(lines[i])
        if m is None:
            out.append(lines[i])
            i += 1
            continue
        closing, name = m.groups()
        if closing:
            raise ResultError(f"{where}:{i + 1}: <!-- /figures:{name} --> without its opening marker")
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == f"<!-- /figures:{name} -->"), None)
        if end is None:
            raise ResultError(f"{where}:{i + 1}: figures:{name} has no closing marker")
        if name not in sections:
            raise ResultError(f"{where}:{i + 1}: no section named {name!r} in benchmarks/sections.py")
        section = Section(results)
        body = sections[name](section)
        sources = section.sources()
        if not sources:
            raise ResultError(f"{where}:{i + 1}: section {name!r} shows no figure from a result file")
        out += [lines[i], *body, "", "Measured with:", "", *(f"- {s}" for s in sources)]
        out.append(lines[end])
        i = end + 1
    return "\n".join(out)


def render_all(root: Path = ROOT, results: Results | None = None, write: bool = True) -> list[str]:
    """Render every document; returns the names of those that changed (written when ``write``)."""
    results = results or Results(root / "benchmarks" / "results")
    changed = []
    for doc in DOCUMENTS:
        path = root / doc
        if not path.exists():
            continue
        old = path.read_text()
        new = render_document(old, results, doc)
        if new != old:
            changed.append(doc)
            if write:
                path.write_text(new)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a section is out of date")
    args = ap.parse_args(argv)
    try:
        changed = render_all(write=not args.check)
    except ResultError as err:
        print(f"render_docs: {err}", file=sys.stderr)
        return 2
    if args.check and changed:
        print(
            "render_docs: out of date: " + ", ".join(changed) + " (run python benchmarks/render_docs.py)",
            file=sys.stderr,
        )
        return 1
    for doc in changed:
        print(f"rewrote the generated sections of {doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
