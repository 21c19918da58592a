"""The generated sections of README.md and docs/benchmarks.md: one function per section, named
in :data:`SECTIONS`, building its lines from result files through ``render_docs.Section`` (every
figure read from a file; the renderer names the files under the section). A section may show a
file only where it exists (``s.has``): the GPU columns appear once a GPU check's files are in.

Standard library only, like render_docs.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["SECTIONS"]

SECTIONS: dict[str, Callable[[Any], list[str]]] = {}

# The user-cost files: (column title, throughput file, step_cost file and mode, loop_wait file).
CPU_SMALL = ("throughput-small", "step_cost", "loop_wait-small")
CPU_BENCH = ("throughput-bench", "step_cost-bench", "loop_wait-bench")
GPU_BENCH = ("throughput-gpu", "step_cost-gpu", "loop_wait-gpu")


def section(name: str) -> Callable[[Callable[[Any], list[str]]], Callable[[Any], list[str]]]:
    def register(fn: Callable[[Any], list[str]]) -> Callable[[Any], list[str]]:
        SECTIONS[name] = fn
        return fn

    return register


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _duration(ms: float) -> str:
    return f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1e3:.1f} s"


def _pct(s: Any, name: str, key: str) -> str:
    v = s.value(name, key)
    return f"{v:+.1f} %"


def _columns(s: Any) -> list[tuple[str, tuple[str, str, str]]]:
    cols = []
    for files in (CPU_SMALL, CPU_BENCH, GPU_BENCH):
        tp = files[0]
        if files is GPU_BENCH and not s.has(tp):
            continue
        d = s.details(tp)
        where = "GPU" if files is GPU_BENCH else "CPU"
        step_text = _duration(s.value(tp, "step_ms"))
        cols.append((f"{where}: {d['model_description']}, a step of {step_text}", files))
    return cols


@section("readme-cost")
def readme_cost(s: Any) -> list[str]:
    cols = _columns(s)
    out = [_row(["", *(title for title, _ in cols)]), _row(["---"] * (len(cols) + 1))]
    rows: list[tuple[str, Callable[[tuple[str, str, str]], str]]] = [
        (
            "**training throughput with the default policy and its saves**, against no checkpointing",
            lambda f: (
                f"**{s.fig(f[0], 'ratio', '{:.3f}')}** (a save every {s.value(f[0], 'interval_s'):.0f} s)"
            ),
        ),
        (
            "monitoring only, no step saves (`step_cost.py`): time inside smartckpt's code per step; "
            "time per step against no checkpointing, median (quartiles)",
            lambda f: (
                f"{s.value(f[1], 'api.inside_pct'):.2f} %; {_pct(s, f[1], 'api.overhead_pct')} "
                f"({s.value(f[1], 'api.overhead_q1_pct'):+.1f} .. {s.value(f[1], 'api.overhead_q3_pct'):+.1f} %)"
            ),
        ),
        (
            "loop wait per save, from the loop's clock: the first save / later saves",
            lambda f: f"{s.fig(f[0], 'first_wait_ms', '{:.0f}')} / {s.fig(f[0], 'later_wait_ms', '{:.0f}')}",
        ),
        (
            "copy overlapped with the next step, the same way: smartckpt `mgr.step()` / DCP `async_save`",
            lambda f: (
                f"{s.fig(f[2], 'smartckpt_lazy.wait_ms', '{:.0f}')} / {s.fig(f[2], 'dcp_async_staged.wait_ms', '{:.0f}')}"
            ),
        ),
        (
            "copy inside the call, the same way: smartckpt `mgr.save()` / DCP `async_save`",
            lambda f: (
                f"{s.fig(f[2], 'smartckpt_eager.wait_ms', '{:.0f}')} / {s.fig(f[2], 'dcp_in_call.wait_ms', '{:.0f}')}"
            ),
        ),
    ]
    for label, cell in rows:
        out.append(_row([label, *(cell(files) for _, files in cols)]))
    if len(cols) < 3:
        out += [
            "",
            "These figures are the CPU's: `bash benchmarks/gpu_check.sh RESULTS_DIR`, run on a GPU machine, adds",
            "a GPU column.",
        ]
    return out


@section("cost")
def cost(s: Any) -> list[str]:
    cols = _columns(s)
    out = [_row(["", *(title for title, _ in cols)]), _row(["---"] * (len(cols) + 1))]
    rows: list[tuple[str, Callable[[tuple[str, str, str]], str]]] = [
        # Not steps/s without / with: those two medians are over different sets of cycles (the
        # first cycle counts in one only), so side by side they would mislead; the ratio is per cycle.
        (
            "a training step without checkpointing (median)",
            lambda f: s.fig(f[0], "step_ms", "{:.1f}"),
        ),
        (
            "throughput with the default policy and its saves / without: median (quartiles; range)",
            lambda f: (
                f"**{s.fig(f[0], 'ratio', '{:.4f}')}** ({s.value(f[0], 'ratio_q1'):.4f} .. {s.value(f[0], 'ratio_q3'):.4f}; {s.value(f[0], 'ratio_min'):.4f} .. {s.value(f[0], 'ratio_max'):.4f})"
            ),
        ),
        (
            "cycles of the policy in the median; saves the policy took",
            lambda f: f"{s.fig(f[0], 'cycles')}; {s.fig(f[0], 'saves')}",
        ),
        (
            "seconds of training from one save to the next (the policy's interval)",
            lambda f: s.fig(f[0], "interval_s", "{:.1f}"),
        ),
        (
            "the cycle of the first save (a fresh manager)",
            lambda f: s.fig(f[0], "ratio_first_cycle", "{:.4f}"),
        ),
        (
            "before the first save, the same chunks (monitoring only)",
            lambda f: s.fig(f[0], "ratio_no_save", "{:.4f}"),
        ),
        (
            "loop wait per save, step-time difference: first save",
            lambda f: s.fig(f[0], "first_wait_ms", "{:.1f}"),
        ),
        ("the same, later saves (median)", lambda f: s.fig(f[0], "later_wait_ms", "{:.1f}")),
        (
            "what the later steps lose until a save commits (median of later saves)",
            lambda f: s.fig(f[0], "later_background_ms", "{:.0f}"),
        ),
        (
            "the library's own counter (`SaveHandle.loop_wait_seconds`): first / later",
            lambda f: (
                f"{s.fig(f[0], 'first_library_wait_ms', '{:.1f}')} / {s.fig(f[0], 'later_library_wait_ms', '{:.1f}')}"
            ),
        ),
        (
            "monitoring only, no step saves (`step_cost.py`): median (quartiles)",
            lambda f: (
                f"{_pct(s, f[1], 'api.overhead_pct')} ({_pct(s, f[1], 'api.overhead_q1_pct')} .. {_pct(s, f[1], 'api.overhead_q3_pct')})"
            ),
        ),
        (
            "time inside smartckpt's code per step, no save",
            lambda f: (
                f"{s.fig(f[1], 'api.inside_us', '{:.0f}')} ({s.value(f[1], 'api.inside_pct'):.2f} % of a step)"
            ),
        ),
    ]
    for label, cell in rows:
        out.append(_row([label, *(cell(files) for _, files in cols)]))
    if len(cols) < 3:
        out += ["", "GPU column: pending (see [GPU check](#gpu-check))."]
    return out


@section("loop-wait")
def loop_wait(s: Any) -> list[str]:
    files = [
        f
        for f in ("loop_wait-small", "loop_wait-bench", "loop_wait-gpu")
        if f == "loop_wait-small" or s.has(f)
    ]
    out = []
    for f in files:
        d = s.details(f)
        out += [
            f"{d['model_description']}, {s.fig(f, 'rounds')} rounds after a warm-up round, a training "
            f"step of {_duration(s.value(f, 'step_ms'))} before each save:",
            "",
            _row(
                [
                    "way of saving",
                    "copy",
                    "loop wait per save: median (smallest .. largest)",
                    "later steps lose until written",
                    "written after",
                    "first save's loop wait",
                ]
            ),
            _row(["---"] * 6),
        ]
        for key, label, copy in (
            ("smartckpt_lazy", "smartckpt `mgr.step()`", "overlapped with the next step"),
            (
                "dcp_async_staged",
                "DCP `async_save`, `DefaultStager` with async staging",
                "overlapped with the next step",
            ),
            ("smartckpt_eager", "smartckpt `mgr.save()`", "inside the call"),
            ("dcp_in_call", "DCP `async_save`, no stager", "inside the call"),
        ):
            out.append(
                _row(
                    [
                        label,
                        copy,
                        f"**{s.fig(f, key + '.wait_ms', '{:.1f}')}** ({s.value(f, key + '.wait_min_ms'):.1f} .. {s.value(f, key + '.wait_max_ms'):.1f})",
                        s.fig(f, key + ".background_ms", "{:.0f}"),
                        s.fig(f, key + ".written_s", "{:.2f}"),
                        s.fig(f, key + ".first_wait_ms", "{:.0f}")
                        if s.has(f, key + ".first_wait_ms")
                        else "-",
                    ]
                )
            )
        out.append("")
    return out[:-1]


@section("monitoring")
def monitoring(s: Any) -> list[str]:
    out = [
        _row(
            [
                "model",
                "mode",
                "ranks",
                "step without / with, ms",
                "per-step overhead: median (quartiles)",
                "inside smartckpt, per step",
                "pairs",
                "evaluation every",
            ]
        ),
        _row(["---"] * 8),
    ]
    for f in ("step_cost", "step_cost-bench", "step_cost-2ranks", "step_cost-gpu"):
        if f != "step_cost" and not s.has(f):
            continue
        d = s.details(f)
        m = d["model"]
        model = m.get("bench") or f"MLP {m['layers']}x{m['width']}"
        model += f", batch {m['batch']}"
        for mode, label in (("api", "API, `mgr.step()`"), ("zero_code", "zero-code, `smartckpt run`")):
            if not s.has(f, f"{mode}.overhead_pct"):
                continue
            out.append(
                _row(
                    [
                        model,
                        label,
                        str(d["ranks"]),
                        f"{s.value(f, mode + '.step_ms_without'):.2f} / {s.value(f, mode + '.step_ms_with'):.2f}",
                        f"**{_pct(s, f, mode + '.overhead_pct')}** ({_pct(s, f, mode + '.overhead_q1_pct')} .. {_pct(s, f, mode + '.overhead_q3_pct')})",
                        f"{s.fig(f, mode + '.inside_us', '{:.0f}')} = {s.value(f, mode + '.inside_pct'):.2f} %",
                        s.fig(f, mode + ".pairs"),
                        f"{s.value(f, mode + '.eval_every'):.0f} steps",
                    ]
                )
            )
    return out


@section("bench")
def bench(s: Any) -> list[str]:
    f = "bench"
    d = s.details(f)
    gb = s.value(f, "state_bytes") / 1e9
    out = [
        f"{s.value(f, 'params') / 1e6:.0f}M parameters, {gb:.2f} GB of state; DCP `async_save` staging: "
        f"{d.get('dcp_async_staging')}; median of {d['reps']} repetitions.",
        "",
        _row(["measure", "seconds", "against"]),
        _row(["---"] * 3),
    ]
    rows = [
        ("bound.copy", "copy into preallocated buffers (lower bound)", None),
        ("bound.write+fsync", f"sequential write + fsync of {gb:.2f} GB (lower bound)", None),
        ("torch.save+fsync", "`torch.save` + fsync", None),
        ("dcp.save", "DCP `save`", "ratio: committed / DCP save"),
        (
            "dcp.async_save.total",
            "DCP `async_save`, until written",
            "ratio: committed / DCP async_save total",
        ),
        (
            "smartckpt.blocking",
            "smartckpt `save()`, blocking (eager copy)",
            "ratio: blocking / copy lower bound",
        ),
        ("smartckpt.committed", "smartckpt, until committed", "ratio: committed / torch.save+fsync"),
        (
            "smartckpt.lazy_step_extra",
            "loop wait, step-time difference: smartckpt `mgr.step()` (lazy)",
            "ratio: step-time difference: lazy / DCP async_save",
        ),
        (
            "smartckpt.eager_step_extra",
            "loop wait, step-time difference: smartckpt `save()` (eager)",
            "ratio: step-time difference: eager / DCP async_save",
        ),
        ("dcp.async_save.step_extra", "loop wait, step-time difference: DCP `async_save`", None),
        (
            "smartckpt.lazy_loop_wait",
            "the library's own counter of the lazy loop wait",
            "ratio: library's lazy loop wait counter / copy lower bound",
        ),
        ("torch.load+load_state_dict", "`torch.load` + `load_state_dict`", None),
        ("dcp.load", "DCP `load` + `set_state_dict`", None),
        (
            "smartckpt.restore",
            "smartckpt restore (verify every chunk + load)",
            "ratio: restore / torch.load+load_state_dict",
        ),
        ("train_step", "one training step", None),
    ]
    for key, label, ratio in rows:
        if not s.has(f, key):
            continue
        against = ""
        if ratio and s.has(f, ratio):
            against = f"{s.fig(f, ratio, '{:.3f}')} ({ratio.removeprefix('ratio: ')})"
        out.append(_row([label, s.fig(f, key, "{:.3f}").removesuffix(" s"), against]))
    out.append(
        _row(
            [
                "bytes on disk: smartckpt / `torch.save`",
                f"{s.value(f, 'bytes.smartckpt') / 1e9:.3f} GB / {s.value(f, 'bytes.torch.save') / 1e9:.3f} GB",
                f"{s.value(f, 'bytes.smartckpt') / s.value(f, 'bytes.torch.save'):.3f}×",
            ]
        )
    )
    if s.has(f, "throughput.none.steps_per_s"):
        every = d["throughput"]["every_seconds"]
        out += [
            "",
            f"Training throughput with a save every {every:g} s, median of {d['throughput']['rounds']} rotated rounds:",
            "",
            _row(["contender", "steps/s", "against no checkpointing"]),
            _row(["---"] * 3),
        ]
        for name in ("none", "torch.save", "dcp.async_save", "smartckpt"):
            out.append(
                _row(
                    [
                        name,
                        s.fig(f, f"throughput.{name}.steps_per_s", "{:.3f}").removesuffix(" steps/s"),
                        s.fig(f, f"throughput.{name}.ratio", "{:.3f}"),
                    ]
                )
            )
    return out


@section("first-save")
def first_save(s: Any) -> list[str]:
    out = [
        _row(
            [
                "staging",
                "loop wait, step-time difference: first save",
                "later saves (median)",
                "first / later",
                "the library's counter: first / later",
            ]
        ),
        _row(["---"] * 5),
    ]
    for f, label in (
        ("first_save", "prepared in the background"),
        ("first_save-ram", "the RAM tier's slot, prepared in the background (`--ram`)"),
        ("first_save-no-prepare", "not prepared (`--no-prepare`)"),
    ):
        if f != "first_save" and not s.has(f):
            continue
        extra = (
            f" (in {s.value(f, 'prepared_s'):.1f} s)"
            if s.has(f, "prepared_s") and s.value(f, "prepared_s") > 0
            else ""
        )
        out.append(
            _row(
                [
                    label + extra,
                    s.fig(f, "first_ms", "{:.0f}"),
                    s.fig(f, "later_ms", "{:.0f}"),
                    f"**{s.fig(f, 'first_over_later', '{:.2f}')}**"
                    if s.value(f, "later_ms") > 0 and s.value(f, "first_ms") > 0
                    else "— (a step-time difference here is not above the noise)",
                    f"{s.fig(f, 'first_library_ms', '{:.0f}')} / {s.fig(f, 'later_library_ms', '{:.0f}')}"
                    f" ({s.fig(f, 'first_over_later_library', '{:.2f}')})",
                ]
            )
        )
    return out


@section("sizes")
def sizes(s: Any) -> list[str]:
    f = "sizes"
    out = [
        _row(
            ["model", "precision", "bytes on disk against `torch.save`", "without the word-embedding table"]
        ),
        _row(["---"] * 4),
    ]
    for label, what in (("tinylm", "decoder LM"), ("minilm", "all-MiniLM-L6-v2, a real fine-tune")):
        if not s.has(f, f"{label}.params"):
            continue
        for prec in ("exact", "bf16", "fp16"):
            if s.has(f, f"{label}.{prec}.ratio"):
                out.append(
                    _row(
                        [
                            f"{what}, {s.value(f, label + '.params') / 1e6:.1f}M parameters, AdamW",
                            prec,
                            f"**{s.fig(f, f'{label}.{prec}.ratio', '{:.3f}')}**",
                            s.fig(f, f"{label}.{prec}.ratio_without_embedding", "{:.3f}"),
                        ]
                    )
                )
    if s.has(f, "frozen.ratio"):
        out.append(
            _row(
                [
                    f"second checkpoint with {s.value(f, 'frozen.fraction_pct'):.0f} % of the parameters frozen",
                    "exact",
                    f"**{s.fig(f, 'frozen.ratio', '{:.3f}')}** the raw bytes of the trainable parameters and their AdamW state",
                    "",
                ]
            )
        )
    return out


@section("precision")
def precision(s: Any) -> list[str]:
    f = "precision"
    out = [
        _row(
            ["", "moment", "nonzero values", "→ 0", "→ inf", "largest relative error", "kept exactly beside"]
        ),
        _row(["---"] * 7),
    ]
    for label in ("bf16", "fp16", "half", "bfloat16"):
        for m in ("exp_avg", "exp_avg_sq"):
            k = f"roundtrip.{label}.{m}"
            if not s.has(f, k + ".nonzero"):
                continue
            name = f"smartckpt {label}" if label in ("bf16", "fp16") else f"plain `.{label}()`"
            out.append(
                _row(
                    [
                        name,
                        m,
                        s.fig(f, k + ".nonzero", "{:,.0f}"),
                        s.fig(f, k + ".to_zero", "{:,.0f}"),
                        s.fig(f, k + ".to_inf", "{:,.0f}"),
                        s.fig(f, k + ".max_rel_err", "{:.1e}"),
                        s.fig(f, k + ".patched", "{:,.0f}") if s.has(f, k + ".patched") else "-",
                    ]
                )
            )
    resumes = [
        k.removeprefix("resume.").removesuffix(".final_loss_diff")
        for k in s.data(f)["figures"]
        if k.endswith(".final_loss_diff")
    ]
    if resumes:
        steps = s.details(f)["config"]["continue_steps"]
        out += [
            "",
            _row(
                [
                    "resumed from",
                    f"|loss difference| {steps} steps later, against the exact resume",
                    "|held-out loss difference|",
                ]
            ),
            _row(["---"] * 3),
        ]
        for r in resumes:
            if r == "exact":
                continue
            out.append(
                _row(
                    [
                        r,
                        s.fig(f, f"resume.{r}.final_loss_diff", "{:.1e}"),
                        s.fig(f, f"resume.{r}.eval_diff", "{:.1e}"),
                    ]
                )
            )
    return out


@section("trigger-eval")
def trigger_eval(s: Any) -> list[str]:
    files = [n for n in s.results.names() if n == "trigger_eval" or n.startswith("trigger_eval-")]
    out = [
        _row(
            [
                "run",
                "checkpoints: plain / spike trace",
                "lost work adaptive / fixed: plain / spike trace",
                "distance, fixed / adaptive: at the event end / at the onset",
                "clean distance adaptive / fixed",
            ]
        ),
        _row(["---"] * 5),
    ]
    for f in files:
        cmd = s.data(f)["command"].removeprefix("python benchmarks/trigger_eval.py").strip() or "defaults"
        dist = s.fig(f, "spikes.distance_ratio", "{:.2f}") if s.has(f, "spikes.distance_ratio") else "-"
        onset = s.fig(f, "onset.distance_ratio", "{:.2f}") if s.has(f, "onset.distance_ratio") else "-"
        clean = (
            f"{s.value(f, 'spikes.clean_adaptive_s'):.1f} s / {s.value(f, 'spikes.clean_fixed_s'):.1f} s"
            if s.has(f, "spikes.clean_adaptive_s")
            else "-"
        )
        out.append(
            _row(
                [
                    f"`{cmd}`",
                    f"{s.fig(f, 'clean.checkpoints')} / {s.fig(f, 'spikes.checkpoints')}",
                    f"{s.fig(f, 'clean.lost_ratio', '{:.3f}')} / {s.fig(f, 'spikes.lost_ratio', '{:.3f}')}",
                    f"{dist} / {onset}",
                    clean,
                ]
            )
        )
    return out


@section("verify-speed")
def verify_speed(s: Any) -> list[str]:
    f = "verify_speed"
    out = [
        f"A checkpoint of {s.fig(f, 'raw_gb', '{:.2f}')} raw, {s.fig(f, 'on_disk_gb', '{:.2f}')} on disk in "
        f"{s.fig(f, 'blobs')} blobs; every figure from a cold page cache:",
        "",
        _row(["read", "GB/s"]),
        _row(["---"] * 2),
    ]
    for k in ("read", "read WILLNEED", "read O_DIRECT", "verify"):
        if s.has(f, f"{k}.gb_s"):
            out.append(
                _row(
                    [
                        "`smartckpt verify`" if k == "verify" else k,
                        s.fig(f, f"{k}.gb_s", "{:.2f}").removesuffix(" GB/s"),
                    ]
                )
            )
    out.append(_row(["**verify / the sequential read bandwidth**", f"**{s.fig(f, 'ratio', '{:.2f}')}**"]))
    return out


@section("plot-speed")
def plot_speed(s: Any) -> list[str]:
    f = "plot_speed"
    return [
        _row(
            [
                "synthetic week",
                "`smartckpt plot DIR -o week.png`, new process",
                "reading",
                "building",
                "drawing",
                "writing the PNG",
                "points drawn",
            ]
        ),
        _row(["---"] * 7),
        _row(
            [
                f"{s.value(f, 'rows'):,.0f} trace rows in {s.fig(f, 'files')} files ({s.fig(f, 'trace_mb', '{:.0f}')}), "
                f"{s.value(f, 'checkpoints'):,.0f} checkpoints, {s.fig(f, 'failures')} restarts",
                f"**{s.fig(f, 'plot_s', '{:.1f}')}**",
                s.fig(f, "load_s", "{:.1f}"),
                s.fig(f, "build_s", "{:.1f}"),
                s.fig(f, "draw_s", "{:.1f}"),
                s.fig(f, "save_s", "{:.1f}"),
                s.fig(f, "points", "{:,.0f}"),
            ]
        ),
    ]


@section("odirect")
def odirect(s: Any) -> list[str]:
    f = "odirect"
    cells = [
        s.fig(f, f"{k}.gb_s", "{:.2f}") if s.has(f, f"{k}.gb_s") else "refused"
        for k in ("buffered", "O_DIRECT")
    ]
    return [_row(["write + fsync", "buffered", "O_DIRECT"]), _row(["---"] * 3), _row(["throughput", *cells])]


@section("remote-tier")
def remote_tier(s: Any) -> list[str]:
    files = [n for n in s.results.names() if n == "remote_tier" or n.startswith("remote_tier-")]
    out = [
        _row(
            [
                "remote",
                "step median / p90, without → with",
                "loop wait per save (library's counter), without → with",
                "lag at the loop's end",
                "close waited",
                "sent",
                "restore after wipe",
            ]
        ),
        _row(["---"] * 7),
    ]
    for f in files:
        d = s.details(f)
        where = d["remote"] + (f", {d['bandwidth_mb']:g} MiB/s cap" if d.get("bandwidth_mb") else "")
        out.append(
            _row(
                [
                    where,
                    f"{s.value(f, 'local.step_median_ms'):.0f} / {s.value(f, 'local.step_p90_ms'):.0f} → "
                    f"{s.value(f, 'remote.step_median_ms'):.0f} / {s.value(f, 'remote.step_p90_ms'):.0f} ms",
                    f"{s.value(f, 'local.loop_wait_ms'):.1f} → {s.value(f, 'remote.loop_wait_ms'):.1f} ms",
                    s.fig(f, "remote.lag_at_end"),
                    s.fig(f, "remote.close_s", "{:.1f}"),
                    s.fig(f, "remote.sent_mb", "{:.0f}"),
                    f"{s.fig(f, 'remote.restore_s', '{:.2f}')} (step {s.value(f, 'remote.restored_step'):.0f})",
                ]
            )
        )
    return out


@section("remote-ranks")
def remote_ranks(s: Any) -> list[str]:
    files = [n for n in s.results.names() if n == "remote_ranks" or n.startswith("remote_ranks-")]
    out = [
        _row(
            [
                "run",
                "ranks",
                "rank",
                "sent per checkpoint",
                "blobs sent / found remote",
                "upload lag mean / max",
                "close waited",
                "restore",
                "fetched",
            ]
        ),
        _row(["---"] * 9),
    ]
    for f in files:
        d = s.details(f)
        run = f"{d['mode']}, {d['params']:.2g} parameters, {d['remote']}"
        keys = sorted({k.split(".")[0] + "." + k.split(".")[1] for k in s.data(f)["figures"]})
        for key in keys:
            n, rank = key.split(".")
            out.append(
                _row(
                    [
                        run,
                        n.removeprefix("r"),
                        rank.removeprefix("rank"),
                        s.fig(f, key + ".per_part_mb", "{:.1f}"),
                        f"{s.fig(f, key + '.blobs_sent')} / {s.fig(f, key + '.blobs_found')}",
                        f"{s.value(f, key + '.lag_mean_s'):.2f} / {s.value(f, key + '.lag_max_s'):.2f} s",
                        s.fig(f, key + ".close_s", "{:.2f}"),
                        s.fig(f, key + ".restore_s", "{:.2f}"),
                        s.fig(f, key + ".fetched_mb", "{:.1f}"),
                    ]
                )
            )
    return out


@section("elastic")
def elastic(s: Any) -> list[str]:
    files = [n for n in s.results.names() if n == "elastic_read" or n.startswith("elastic_read-")]
    out = [
        _row(["checkpoint", "restored on", "the most a rank read", "share of the checkpoint", "against 1/M"]),
        _row(["---"] * 5),
    ]
    for f in files:
        d = s.details(f)
        ck = f"{s.fig(f, 'stored_mb', '{:.0f}')}, {d['layers']} layers of {d['width']}, saved by {d['save_ranks']} ranks, `chunk_mb` {d['chunk_mb']}"
        for k in sorted(
            (k for k in s.data(f)["figures"] if k.endswith(".read_mb")),
            key=lambda k: int(k[1:].split(".")[0]),
        ):
            m = k.split(".")[0]
            out.append(
                _row(
                    [
                        ck,
                        f"{m[1:]} ranks",
                        s.fig(f, k, "{:.1f}"),
                        f"{s.value(f, m + '.share_pct'):.1f} %",
                        s.fig(f, m + ".vs_fair", "{:.2f}"),
                    ]
                )
            )
    return out


@section("soak")
def soak(s: Any) -> list[str]:
    f = "soak"
    return [
        _row(
            [
                "consecutive saves",
                "one staging copy",
                "resident memory growth after the warm-up",
                "file descriptors",
                "threads",
                "failed saves",
            ]
        ),
        _row(["---"] * 6),
        _row(
            [
                s.fig(f, "saves"),
                s.fig(f, "staging_mb", "{:.0f}"),
                f"{s.fig(f, 'rss_growth_mb', '{:+.0f}')} ({s.value(f, 'rss_growth_over_staging'):+.2f} staging copies)",
                f"{s.fig(f, 'fds_before')} → {s.fig(f, 'fds_after')}",
                f"{s.fig(f, 'threads_before')} → {s.fig(f, 'threads_after')}",
                s.fig(f, "failures"),
            ]
        ),
    ]


@section("coordination")
def coordination(s: Any) -> list[str]:
    f = "coordination"
    ranks = sorted(
        {int(k.rsplit("_", 1)[1]) for k in s.data(f)["figures"] if k.startswith("decide_us_idle_")}
    )
    rows: list[tuple[str, Callable[[int], str]]] = [
        ("decision agreements per save", lambda n: s.fig(f, f"decisions_per_save_{n}")),
        ("one agreement, training stopped", lambda n: s.fig(f, f"decide_us_idle_{n}", unit="ms")),
        ("one agreement during training", lambda n: s.fig(f, f"decide_us_training_{n}", unit="ms")),
        (
            "commit: messages sent per save, rank 0 / another rank / all ranks",
            lambda n: (
                f"{s.fig(f, f'commit_messages_rank0_{n}')} / {s.fig(f, f'commit_messages_other_{n}')} / "
                f"{s.fig(f, f'commit_messages_total_{n}')}"
            ),
        ),
        (
            "commit: bytes sent per save, another rank / all ranks",
            lambda n: f"{s.fig(f, f'commit_sent_other_B_{n}')} / {s.fig(f, f'commit_sent_total_B_{n}')}",
        ),
        ("last rank's part durable → commit line durable", lambda n: s.fig(f, f"last_part_to_commit_ms_{n}")),
        ("snapshot → commit line, training going on", lambda n: s.fig(f, f"snapshot_to_commit_ms_{n}")),
        (
            "files / bytes written per save",
            lambda n: (
                f"{s.fig(f, f'files_per_save_{n}')} / {s.fig(f, f'bytes_per_save_{n}', '{:.2f}', unit='MB')}"
            ),
        ),
    ]
    out = [_row(["per save (medians)", *(f"{n} ranks" for n in ranks)]), _row(["---"] * (len(ranks) + 1))]
    for label, cell in rows:
        out.append(_row([label, *(cell(n) for n in ranks)]))
    return out


@section("resume-check")
def resume_check(s: Any) -> list[str]:
    files = [n for n in s.results.names() if n == "resume_check_cost" or n.startswith("resume_check_cost-")]
    out = [
        _row(
            [
                "model",
                "training step",
                "check, training thread",
                "save, blocking part",
                "check / save (quartiles)",
                "check / step",
                "check, save thread",
            ]
        ),
        _row(["---"] * 7),
    ]
    for f in files:
        out.append(
            _row(
                [
                    s.details(f)["model_description"],
                    s.fig(f, "step_ms", "{:.1f}"),
                    s.fig(f, "check_ms", "{:.1f}"),
                    s.fig(f, "save_ms", "{:.0f}"),
                    f"{s.fig(f, 'check_over_save_pct', '{:.1f}')} "
                    f"({s.value(f, 'check_over_save_q1_pct'):.1f} .. {s.value(f, 'check_over_save_q3_pct'):.1f} %)",
                    s.fig(f, "check_over_step_pct", "{:.2f}"),
                    s.fig(f, "save_thread_ms", "{:.1f}"),
                ]
            )
        )
    return out


@section("ddp-sum-order")
def ddp_sum_order(s: Any) -> list[str]:
    f = "ddp_sum_order"
    ranks = sorted({int(k.rsplit("_", 1)[1]) for k in s.data(f)["figures"] if k.startswith("gloo_differ_")})
    out = [
        _row(
            [
                "ranks",
                "gloo: sums of 4,096 that differ in another layout",
                "DDP weights of 1,153 differing: resumed as it comes / layout given back",
                "the same with `find_unused_parameters=True`",
            ]
        ),
        _row(["---"] * 4),
    ]
    for n in ranks:
        out.append(
            _row(
                [
                    str(n),
                    s.fig(f, f"gloo_differ_{n}"),
                    f"{s.fig(f, f'resume_differ_{n}')} / {s.fig(f, f'relaid_differ_{n}')}",
                    f"{s.fig(f, f'unused_resume_differ_{n}')} / {s.fig(f, f'unused_relaid_differ_{n}')}",
                ]
            )
        )
    return out


@section("save-what-changed")
def save_what_changed(s: Any) -> list[str]:
    f = "save_what_changed"
    d = s.details(f)
    frozen = 100 * d["frozen_bytes"] / d["state_bytes"]
    out = [
        _row(["state registered", "copied and hashed per save", "the save call", "the background persist"]),
        _row(["---"] * 4),
    ]
    for tag, label in (
        ("whole_model", f"the whole model ({frozen:.0f} % of its weights frozen)"),
        ("adapters_alone", "its adapters alone"),
    ):
        out.append(
            _row(
                [
                    label,
                    s.fig(f, f"{tag}_bytes_copied", "{:.2f}", unit="MB"),
                    s.fig(f, f"{tag}_save_call", "{:.1f}", unit="ms"),
                    s.fig(f, f"{tag}_persist", "{:.1f}", unit="ms"),
                ]
            )
        )
    out.append(
        _row(
            [
                "whole / adapters alone",
                f"**{s.fig(f, 'copied_ratio', '{:.2f}')}**",
                f"**{s.fig(f, 'save_call_ratio', '{:.2f}')}**",
                "",
            ]
        )
    )
    return out


# The save_memory contenders in table order, with how the docs name them.
_MEMORY_ROWS = (
    ("torch.save", "`torch.save`"),
    ("dcp.async_save", "DCP `async_save`"),
    ("dcp.async_save+shm-stager", "DCP `async_save`, `DefaultStager` (shared memory)"),
    ("smartckpt", "smartckpt, API"),
    ("smartckpt run (RAM tier)", "smartckpt run (RAM tier, one slot: the default)"),
    ("smartckpt run (ram_slots 2)", "smartckpt run, `ram_slots: 2`"),
    (
        "smartckpt run (memory_budget 2.5 S)",
        "smartckpt run, `memory_budget` 2.5 S (two slots, by the budget)",
    ),
    ("smartckpt (memory_budget 0.5 S)", "smartckpt, API, `memory_budget` 0.5 S (saves in pieces)"),
)
_LORA_ROWS = (
    ("smartckpt, LoRA-shaped", "smartckpt, API, the whole model registered"),
    ("smartckpt, LoRA-shaped: adapters alone", "smartckpt, API, its adapters alone (the ideal save)"),
    ("smartckpt run, LoRA-shaped", "smartckpt run (RAM tier), the whole model"),
)
# A 7B full fine-tune on one 8-GPU node: bf16 weights and gradients on the GPUs, fp32 master
# weights and two AdamW moments: the 98 GB of state per node, the host's to stage.
_NODE_STATE_GB = 98.0
# A 13B LoRA on one 8-GPU node (DDP): each rank holds the 26 GB bf16 base and its adapters with
# their moments (about 0.3 GB): the state each rank's checkpointer sees, times 8.
_LORA_NODE_GB = 8 * 26.3


def _memory_sizes(s: Any, f: str) -> list[tuple[str, str]]:
    """(figure tag, the MLP's S) per size, smallest first."""
    rows = [r for r in s.details(f)["rows"] if r["who"] == "smartckpt"] or s.details(f)["rows"]
    out = []
    for params in sorted({r["params"] for r in rows}):
        state = next(r["state_bytes"] for r in rows if r["params"] == params)
        out.append((f"{params / 1e6:g}M", f"{state / 1e9:.2f} GB"))
    return out


def _multiple(s: Any, f: str, key: str) -> str:
    return s.fig(f, key, "{:.2f}").replace("×", " S")


@section("save-memory")
def save_memory(s: Any) -> list[str]:
    f = "save_memory"
    sizes = _memory_sizes(s, f)
    # The stall this benchmark also records (save_memory.json) is left out of the table: with a
    # step of seconds on 2 cores, the step time's own noise is larger than a copy of S (negative
    # figures); first_save.py and the save-stall section measure stalls.
    head = ["contender", *(f"extra memory, S = {gb}" for _, gb in sizes)]
    head.append(f"a 7B full fine-tune, {_NODE_STATE_GB:.0f} GB of state per node: extra host memory")
    out = [_row(head), _row(["---"] * len(head))]
    for who, label in _MEMORY_ROWS:
        if not s.has(f, f"extra_memory[{who} @ {sizes[0][0]}]"):
            continue
        cells = [label, *(_multiple(s, f, f"extra_memory[{who} @ {tag}]") for tag, _ in sizes)]
        big = s.value(f, f"extra_memory[{who} @ {sizes[-1][0]}]")
        cells.append(f"{big * _NODE_STATE_GB:.0f} GB")
        out.append(_row(cells))
    lora = [(who, label) for who, label in _LORA_ROWS if s.has(f, f"extra_first[{who} @ {sizes[-1][0]}]")]
    if not lora:
        return out
    tag = sizes[-1][0]
    state = s.value(f, f"state[{lora[0][0]} @ {tag}]")
    frozen = s.value(f, f"frozen[{lora[0][0]} @ {tag}]")
    out += [
        "",
        f"The LoRA-shaped model (S = {state:.2f} GB, {frozen * 100:.0f} % of it frozen): extra memory during the "
        "first two saves (the first copies the frozen base, the second frees that copy) and the later ones:",
        "",
    ]
    head = [
        "contender",
        "first two saves",
        "later saves",
        f"a 13B LoRA, {_LORA_NODE_GB:.0f} GB of state per node: first two saves",
        "later saves",
    ]
    out += [_row(head), _row(["---"] * len(head))]
    for who, label in lora:
        first = s.value(f, f"extra_first[{who} @ {tag}]")
        later = s.value(f, f"extra_later[{who} @ {tag}]")
        out.append(
            _row(
                [
                    label,
                    _multiple(s, f, f"extra_first[{who} @ {tag}]"),
                    _multiple(s, f, f"extra_later[{who} @ {tag}]"),
                    f"{max(0.0, first) * _LORA_NODE_GB:.0f} GB",
                    f"{max(0.0, later) * _LORA_NODE_GB:.0f} GB",
                ]
            )
        )
    return out


@section("against-commit")
def against_commit(s: Any) -> list[str]:
    f = "against_commit"
    commit = s.data(f)["command"].split("--commit", 1)[1].split()[0]
    rows = [
        ("a save: the loop's wait", "save_wait_ms", "{:.1f}", None),
        ("a save: until committed", "save_commit_ms", "{:.0f}", None),
        ("a restore", "restore_ms", "{:.0f}", None),
        ("`mgr.step()` itself, a step without a save", "step_call_ms", "{:.0f}", "us"),
        ("a whole step (torch's compute and its noise)", "step_ms", "{:.0f}", None),
    ]
    out = [_row(["median", f"commit {commit}", "this tree", "this tree / earlier"]), _row(["---"] * 4)]
    for label, key, fmt, unit in rows:
        out.append(
            _row(
                [
                    label,
                    s.fig(f, f"{key}[earlier]", fmt, unit),
                    s.fig(f, f"{key}[this]", fmt, unit),
                    s.fig(f, f"{key}[ratio]", "{:.2f}"),
                ]
            )
        )
    return out
