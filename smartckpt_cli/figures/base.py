"""What every figure shares: matplotlib, imported here and only when a figure is drawn, on the
headless Agg backend; colours; the time axis's unit; writing PNG, SVG or HTML.

matplotlib is an optional extra (``smartckpt[plot]``): the control plane's other commands, and
``smartckpt plot --json``, never import it, and a command that needs it and does not find it
says which extra to install in one line (exit 2) instead of a traceback.
"""

from __future__ import annotations

import html
import io
import os
from pathlib import Path
from typing import Any

from smartckpt_cli.errors import UsageError

__all__ = [
    "CATEGORY_COLORS",
    "FORMATS",
    "LOST",
    "RESTART",
    "check_output",
    "matplotlib",
    "save",
    "table_html",
    "time_unit",
]

FORMATS = (".png", ".svg", ".html")

# Colour-blind-safe (Okabe-Ito, and Tol's wine), one per checkpoint category; restarts and lost
# work in vermillion.
CATEGORY_COLORS = {
    "scheduled": "#0072B2",
    "budget": "#E69F00",
    "precursor": "#009E73",
    "signal": "#CC79A7",
    "preemption": "#882255",
    "final": "#000000",
    "manual": "#999999",
}
RESTART = "#D55E00"
LOST = "#D55E00"


def matplotlib() -> Any:
    """The matplotlib module, on the Agg backend (no display is ever needed)."""
    try:
        import matplotlib as mpl
    except ImportError:
        raise UsageError(
            "drawing needs matplotlib, which is not installed: pip install 'smartckpt[plot]' "
            "(--json needs nothing more)"
        ) from None
    mpl.use("Agg", force=True)
    return mpl


def check_output(path: Path) -> None:
    """Refuse, before any work, an output that cannot be written."""
    if path.suffix.lower() not in FORMATS:
        raise UsageError(f"{path}: the figure's file name must end in .png, .svg or .html")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{path}: directory {parent} is not writable")


def time_unit(span: float) -> tuple[str, float]:
    """A readable unit for a time axis spanning ``span`` seconds: (name, seconds per unit)."""
    if span <= 300:
        return "s", 1.0
    if span <= 3 * 3600:
        return "min", 60.0
    if span <= 72 * 3600:
        return "h", 3600.0
    return "days", 86400.0


def save(fig: Any, path: Path, *, title: str = "", html_body: str = "") -> None:
    """PNG, SVG, or an HTML page with the SVG inline and ``html_body`` below it. Written to a
    temporary name and renamed, so a reader never sees half a figure."""
    suffix = path.suffix.lower()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        if suffix == ".png":
            fig.savefig(tmp, format="png", dpi=fig.dpi, pil_kwargs={"optimize": True})
        elif suffix == ".svg":
            fig.savefig(tmp, format="svg")
        else:
            buf = io.StringIO()
            fig.savefig(buf, format="svg")
            svg = buf.getvalue()
            svg = svg[svg.index("<svg") :]  # inline: no XML declaration or doctype
            tmp.write_text(
                "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
                f"<title>{html.escape(title)}</title>"
                "<style>body{font-family:sans-serif;margin:1em}svg{max-width:100%;height:auto}"
                "table{border-collapse:collapse;font-size:13px;margin-bottom:1em}"
                "td,th{border:1px solid #ccc;padding:2px 6px}th{background:#eee}"
                "td.n{text-align:right}</style></head><body>\n"
                f"<h1>{html.escape(title)}</h1>\n{svg}\n{html_body}\n</body></html>\n"
            )
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def table_html(caption: str, header: list[str], rows: list[list[Any]]) -> str:
    """A plain HTML table (numbers right-aligned)."""
    if not rows:
        return ""
    out = [f"<h2>{html.escape(caption)}</h2><table><tr>"]
    out += [f"<th>{html.escape(h)}</th>" for h in header]
    out.append("</tr>")
    for row in rows:
        cells = []
        for v in row:
            cls = " class='n'" if isinstance(v, int | float) else ""
            text = "" if v is None else f"{v:,.1f}" if isinstance(v, float) else str(v)
            cells.append(f"<td{cls}>{html.escape(text)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "".join(out)
