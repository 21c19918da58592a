"""summary.md of a GPU check (benchmarks/gpu_check.sh), from the files it left in RESULTS_DIR.

Standard library only: it must run whatever else failed. Every figure is read from the step's own
JSON or JUnit file; a missing file is said as such, never guessed.

    python benchmarks/gpu_check_summary.py --results DIR --steps steps.txt --device cuda --seconds 312 --budget 350
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# Issue 20's targets, as stated there (GPU ones on CUDA, the CPU bench model's on the CPU).
FIRST_SAVE_MAX_S = 0.050  # first-save loop wait for ~5 GB of state on a GPU
FIRST_SAVE_MAX_RATIO = 2.0  # first save / median of later saves on the CPU
THROUGHPUT_MIN = 0.99  # smartckpt with a save every 10 s vs. no checkpointing, on a GPU


def _record(path: Path) -> Any:
    """A result file (docs/benchmarks.md); None when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == "smartckpt-bench-result" else None


def _load(path: Path) -> Any:
    """A result file's measurements (its ``details``: what the script measured); None when the
    file is missing or unreadable."""
    data = _record(path)
    return None if data is None else data.get("details")


def _fig(rec: Any, key: str) -> float | None:
    fig = (rec or {}).get("figures", {}).get(key)
    return None if fig is None else float(fig["value"])


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _verdict(ok: bool | None) -> str:
    return "" if ok is None else (" **(meets the target)**" if ok else " **(misses the target)**")


def steps_table(steps_file: Path) -> list[str]:
    rows = ["| step | exit code | seconds | limit, s |", "|---|---|---|---|"]
    for line in steps_file.read_text().splitlines():
        if line.strip():
            name, rc, secs, limit = line.split("|")
            rows.append(f"| {name} | {rc} | {secs} | {limit} |")
    return rows


def tests_section(path: Path, device: str) -> list[str]:
    out = ["## CUDA tests (kill and resume, bit for bit)" if device == "cuda" else "## Tests", ""]
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return [*out, "no pytest.xml: the tests did not run to the end (see gpu_check.log)", ""]
    cases = root.iter("testcase")
    passed, failed, skipped = [], [], []
    for c in cases:
        name = c.get("name", "?")
        if c.find("failure") is not None or c.find("error") is not None:
            failed.append(name)
        elif c.find("skipped") is not None:
            skipped.append(f"{name}: {c.find('skipped').get('message', '')}")  # type: ignore[union-attr]
        else:
            passed.append(name)
    out.append(f"{len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped")
    if device == "cuda" and not passed:
        out.append("**no CUDA test ran**: the check did not prove anything on the GPU")
    out += [f"- passed: {n}" for n in passed] + [f"- FAILED: {n}" for n in failed]
    out += [f"- skipped: {n}" for n in skipped]
    return [*out, ""]


def bench_section(path: Path, device: str) -> list[str]:
    b = _load(path)
    out = ["## Bench (`smartckpt bench`)", ""]
    if b is None:
        return [
            *out,
            f"no {path.name}: the bench did not run or finish its first part (see gpu_check.log)",
            "",
        ]
    gb = b["state_bytes"] / 1e9
    out.append(
        f"{b.get('device_name', b['device'])}, torch {b.get('torch')}: {b['params'] / 1e6:.0f}M parameters, "
        f"{gb:.2f} GB of state, batch {b.get('batch')}; parts done: {', '.join(b['parts_done']) or 'none'}"
        f"{'' if b.get('complete') else ' (cut short)'}"
    )
    out.append(f"DCP async_save staging: {b.get('dcp_async_staging')}")
    out.append("")
    first = b.get("first_save") or {}
    f, later, ratio = first.get("first_loop_wait"), first.get("median_later_loop_wait"), first.get("ratio")
    if f is not None:
        if device == "cuda":
            ok = f <= FIRST_SAVE_MAX_S if gb >= 4.0 else None
            target = f"target ≤ {FIRST_SAVE_MAX_S * 1e3:.0f} ms for ~5 GB"
        else:
            ok = ratio <= FIRST_SAVE_MAX_RATIO if ratio is not None else None
            target = f"target ≤ {FIRST_SAVE_MAX_RATIO:g}× the later saves"
        r = "-" if ratio is None else f"{ratio:.2f}×"
        out.append(
            f"**First save**: the loop waited {_ms(f)}; later lazy saves {_ms(later)} (median of "
            f"{len(first.get('later_loop_waits') or [])}), ratio {r}; {target}{_verdict(ok)}"
        )
        out.append("")
    tp = b.get("throughput")
    if tp:
        out.append(
            f"**Training throughput, a save every {tp['every_seconds']:g} s** (median of {tp['rounds']} rotated rounds):"
        )
        out += [
            "",
            "| contender | steps/s | vs. no checkpoint | saves | loop wait per save | drain, s |",
            "|---|---|---|---|---|---|",
        ]
        for name, sps in tp["median_steps_per_second"].items():
            waits = tp["loop_wait_seconds"].get(name) or []
            wait = _ms(statistics.median(waits)) if waits else "-"
            ratio_tp = tp["median_ratio_vs_none"][name]
            drain = max(tp["drain_seconds"].get(name) or [0.0])
            out.append(f"| {name} | {sps:.3f} | {ratio_tp:.4f} | {len(waits)} | {wait} | {drain:.2f} |")
        sc = tp["median_ratio_vs_none"].get("smartckpt")
        if device == "cuda" and sc is not None:
            out.append("")
            out.append(
                f"smartckpt keeps {sc:.4f}× no checkpointing; target ≥ {THROUGHPUT_MIN}{_verdict(sc >= THROUGHPUT_MIN)}"
            )
        out.append("")
    med = b.get("median_seconds") or {}
    if med:
        out += [
            f"**One save at a time** (median of {b['reps']}), seconds:",
            "",
            "| measure | seconds |",
            "|---|---|",
        ]
        out += [f"| {k} | {_s(v)} |" for k, v in med.items()]
        out.append("")
        ratios = {k: v for k, v in (b.get("ratios") or {}).items() if v is not None}
        if ratios:
            out += ["| ratio | value |", "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in ratios.items()]
            out.append("")
        sizes = b.get("bytes_on_disk") or {}
        if sizes:
            out.append("bytes on disk: " + ", ".join(f"{k} {v:,}" for k, v in sizes.items()))
            out.append("")
    for note in b.get("notes") or []:
        out.append(f"note: {note}")
    return out


def step_cost_section(results: Path) -> list[str]:
    """One row per mode: the step with and without smartckpt, the throughput kept, the spread."""
    out = [
        "## Monitoring cost, no save (`benchmarks/step_cost.py`)",
        "",
        "| mode | model | ranks | pairs | step without, ms | step with, ms | steps/s kept | overhead (IQR) | inside smartckpt, µs/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    data = _load(results / "step_cost-gpu.json")
    missing = []
    for label, key in (("API", "api"), ("zero-code", "zero_code")):
        mode = data.get(key) if isinstance(data, dict) else None
        if not isinstance(mode, dict):
            missing.append(
                f"- {label}: no figures in step_cost-gpu.json (see the step's exit code and gpu_check.log)"
            )
            continue
        m = data.get("model", {})
        model = m.get("bench") or f"MLP {m.get('layers')}x{m.get('width')}"
        model += f", batch {m.get('batch')}, {m.get('optimizer')}"
        iqr = mode.get("overhead_iqr") or [float("nan"), float("nan")]
        inside = mode.get("inside_us_per_step")
        out.append(
            f"| {label} | {model} | {data.get('ranks')} | {mode.get('pairs')} "
            f"| {mode['step_ms_without']:.3f} | {mode['step_ms_with']:.3f} "
            f"| {mode['steps_per_s_with'] / mode['steps_per_s_without']:.3f}x "
            f"| {100 * mode['overhead_median']:+.2f} % ({100 * iqr[0]:+.2f} .. {100 * iqr[1]:+.2f}) "
            f"| {'-' if inside is None else f'{inside:.1f}'} |"
        )
    return [*out, "", *missing, ""] if missing else [*out, ""]


def loop_wait_section(results: Path) -> list[str]:
    rec = _record(results / "loop_wait-gpu.json")
    out = ["## One save, from the loop's clock (`benchmarks/loop_wait.py`)", ""]
    if rec is None:
        return [*out, "no loop_wait-gpu.json (not asked for, or see gpu_check.log)", ""]
    out += [
        f"{rec['details'].get('model_description')}; loop wait per save, step-time difference, median:",
        "",
        "| way | loop wait | later steps lose until written | written after |",
        "|---|---|---|---|",
    ]
    for key in ("smartckpt_lazy", "dcp_async_staged", "smartckpt_eager", "dcp_in_call"):
        wait, bg, written = (_fig(rec, f"{key}.{k}") for k in ("wait_ms", "background_ms", "written_s"))
        out.append(
            f"| {key} | {_ms(None if wait is None else wait / 1e3)} | {_ms(None if bg is None else bg / 1e3)} | {_s(written)} s |"
        )
    return [*out, ""]


def pinned_section(results: Path) -> list[str]:
    rec = _record(results / "pinned_copy-gpu.json")
    out = ["## Device-to-host copies into staging buffers (`benchmarks/pinned_copy.py`)", ""]
    if rec is None:
        return [*out, "no pinned_copy-gpu.json (not asked for, or see gpu_check.log)", ""]
    out += ["| buffer | GB/s | against pageable |", "|---|---|---|"]
    for name in (
        "pageable",
        "private staging (registered)",
        "RAM slot in /dev/shm (registered)",
        "RAM slot in /dev/shm (not registered)",
    ):
        gbps, x = _fig(rec, f"gbps[{name}]"), _fig(rec, f"speedup[{name}]")
        out.append(
            f"| {name} | {'-' if gbps is None else f'{gbps:.2f}'} | {'-' if x is None else f'{x:.2f}x'} |"
        )
    return [*out, ""]


def throughput_section(results: Path) -> list[str]:
    rec = _record(results / "throughput-gpu.json")
    out = ["## Throughput with the default policy and its saves (`benchmarks/throughput.py`)", ""]
    if rec is None:
        return [*out, "no throughput-gpu.json (not asked for, or see gpu_check.log)", ""]
    ratio, interval = _fig(rec, "ratio"), _fig(rec, "interval_s")
    first, later = _fig(rec, "first_wait_ms"), _fig(rec, "later_wait_ms")
    out.append(
        f"{rec['details'].get('model_description')}: with / without checkpointing "
        f"{'-' if ratio is None else f'{ratio:.4f}x'} (a save every {'-' if interval is None else f'{interval:.0f}'} s); "
        f"loop wait per save, step-time difference: first {_ms(None if first is None else first / 1e3)}, "
        f"later {_ms(None if later is None else later / 1e3)}"
    )
    return [*out, ""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, required=True)
    p.add_argument("--steps", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seconds", type=int, default=0)
    p.add_argument("--budget", type=int, default=0)
    a = p.parse_args()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"# smartckpt GPU check ({a.device}{', CPU dry run' if a.device == 'cpu' else ''}), {when}",
        "",
        f"{a.seconds} s in all (budget {a.budget} s). Exit code 124: the step ran into its time limit.",
        "",
        *steps_table(a.steps),
        "",
        *tests_section(a.results / "pytest.xml", a.device),
        *step_cost_section(a.results),
        *loop_wait_section(a.results),
        *pinned_section(a.results),
        *bench_section(a.results / "bench-gpu.json", a.device),
        *throughput_section(a.results),
        "Every step's output: gpu_check.log.",
    ]
    (a.results / "summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
