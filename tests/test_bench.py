"""`smartckpt bench` as a user runs it, at a size the suite can afford: every figure measured,
every ratio computed from them, the throughput part consistent with itself, smartckpt's
checkpoint restorable and smaller than torch.save's, and nothing left behind in its work
directory. Speed is the bench's job, not this test's."""

from __future__ import annotations

import json
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smartckpt_cli.bench.result import DERIVED, RATIOS
from smartckpt_cli.bench.throughput import CONTENDERS

MEASURES = {
    "bound.copy",
    "bound.write+fsync",
    "torch.save+fsync",
    "torch.load+load_state_dict",
    "dcp.save",
    "dcp.load",
    "dcp.async_save.blocking",
    "dcp.async_save.total",
    "smartckpt.blocking",
    "smartckpt.committed",
    "smartckpt.lazy_loop_wait",
    "smartckpt.restore",
    "train_step",
    "train_step_with_lazy_save",
    "smartckpt.eager_step_with_save",
    "train_step_plain",
    "dcp.async_save.step_with_save",
}
REPS, ROUNDS, EVERY = 2, 2, 0.3


def _bench(*args: str, timeout: float = 540) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory) -> tuple[dict, Path, subprocess.CompletedProcess[str]]:
    tmp = tmp_path_factory.mktemp("bench")
    work, out = tmp / "work", tmp / "bench.json"
    work.mkdir()
    proc = _bench(
        "--device", "cpu", "--params", "3e6", "--reps", str(REPS), "--rounds", str(ROUNDS),
        "--every", str(EVERY), "--workdir", str(work), "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    record = json.loads(out.read_text())
    return record["details"], work, proc, record


@pytest.mark.slow
def test_bench_measures_every_contender_and_cleans_up(bench_run) -> None:
    res, work, proc, _ = bench_run
    assert res["reps"] == REPS and 2.5e6 < res["params"] < 3.5e6
    assert res["device"] == "cpu" and res["complete"] is True
    assert res["parts_done"] == ["first-save", "throughput", "saves"]
    # on CPU too, DCP stages on its own thread, overlapping the next step as smartckpt's lazy copy does
    assert "asynchronous staging on a background thread" in res["dcp_async_staging"]
    assert set(res["median_seconds"]) == MEASURES | set(DERIVED) | {"smartckpt.first_lazy_loop_wait"}
    for name in MEASURES:
        samples = res["samples"][name]
        assert len(samples) == REPS and all(s > 0 for s in samples), name
    assert len(res["samples"]["smartckpt.first_lazy_loop_wait"]) == 1
    assert set(res["ratios"]) == set(RATIOS)
    med = res["median_seconds"]
    for name, (with_save, without) in DERIVED.items():  # the step-time differences, per repetition
        pairs = zip(res["samples"][with_save], res["samples"][without], strict=True)
        assert med[name] == pytest.approx(statistics.median(a - b for a, b in pairs)), name
    for label, (a, b) in RATIOS.items():
        assert res["ratios"][label] == pytest.approx(med[a] / med[b]), label
    sizes = res["bytes_on_disk"]
    # Exact precision, compressed: the same state in fewer bytes than torch.save's pickle.
    assert 0 < sizes["smartckpt"] < sizes["torch.save"]
    assert sizes["dcp.save"] > 0
    assert list(work.iterdir()) == [], "the bench left files in its work directory"
    assert "training throughput, a save every 0.3 s" in proc.stdout


@pytest.mark.slow
def test_bench_json_is_a_result_file_with_its_command_and_figures(bench_run) -> None:
    """`--json` writes the result file every benchmark writes (docs/benchmarks.md): the command
    as run, the machine, and every median, ratio and size as a figure with its unit."""
    res, _, _, record = bench_run
    render_docs = _render_docs()
    problems = render_docs.check_result(record, committed=False)
    assert problems == [], problems
    assert record["command"].startswith("smartckpt bench --device cpu --params 3e6")
    assert record["benchmark"] == "bench" and record["device"]["type"] == "cpu"
    assert record["machine"]["cpus"] >= 1 and record["machine"]["memory_bytes"] > 0
    figures = record["figures"]
    for name, value in res["median_seconds"].items():
        assert figures[name] == {"value": value, "unit": "s", "what": figures[name]["what"]}, name
    for label, value in res["ratios"].items():
        assert figures[f"ratio: {label}"]["value"] == value and figures[f"ratio: {label}"]["unit"] == "x"
    assert figures["bytes.smartckpt"]["value"] == res["bytes_on_disk"]["smartckpt"]
    assert figures["throughput.smartckpt.ratio"]["unit"] == "x"


def _render_docs():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "render_docs.py"
    spec = importlib.util.spec_from_file_location("render_docs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_bench_throughput_figures_are_consistent(bench_run) -> None:
    tp = bench_run[0]["throughput"]
    assert tp["every_seconds"] == EVERY and tp["rounds"] == ROUNDS
    assert set(tp["steps_per_second"]) == set(CONTENDERS)
    for name in CONTENDERS:
        sps, blocks = tp["steps_per_second"][name], tp["block_seconds"][name]
        assert len(sps) == len(blocks) == ROUNDS, name
        for r in range(ROUNDS):
            # a block: one step, the save, then `every` seconds of training at least
            assert blocks[r] >= EVERY, name
            steps = sps[r] * blocks[r]
            assert steps == pytest.approx(round(steps), abs=1e-6) and round(steps) >= 2, name
            assert tp["ratio_vs_none"][name][r] == pytest.approx(sps[r] / tp["steps_per_second"]["none"][r])
        assert tp["median_ratio_vs_none"][name] == pytest.approx(statistics.median(tp["ratio_vs_none"][name]))
        # one save per block for every contender but `none`, each with what the loop waited
        waits = tp["loop_wait_seconds"][name]
        assert len(waits) == (0 if name == "none" else ROUNDS), name
        assert all(w > 0 for w in waits), name
        assert all(d >= 0 for d in tp["drain_seconds"][name])
    assert tp["ratio_vs_none"]["none"] == [1.0] * ROUNDS
    # every lazy save after the first, the throughput part's and the one-at-a-time part's
    first = bench_run[0]["first_save"]
    assert first["first_loop_wait"] > 0
    assert len(first["later_loop_waits"]) == ROUNDS + REPS
    assert first["ratio"] == pytest.approx(first["first_loop_wait"] / first["median_later_loop_wait"])


def test_bench_refuses_bad_options_in_one_line(tmp_path: Path) -> None:
    proc = _bench("--reps", "0", timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "--reps" in proc.stderr


@pytest.mark.parametrize("device", ["tpu", "cuda"])
def test_bench_refuses_a_device_it_cannot_use_in_one_line(tmp_path: Path, device: str) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: --device cuda is valid here")
    proc = _bench("--device", device, "--json", str(tmp_path / "b.json"), timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("smartckpt: error: --device"), proc.stderr
    assert (device == "cuda") == ("no CUDA device" in lines[0])
    assert not (tmp_path / "b.json").exists()


@pytest.mark.slow
def test_bench_stopped_by_sigterm_keeps_its_finished_parts_and_cleans_up(tmp_path: Path) -> None:
    """A time limit's SIGTERM (the GPU check runs the bench under `timeout`): the JSON written
    after the first part stays, the checkpoints the bench wrote are removed."""
    work, out = tmp_path / "work", tmp_path / "bench.json"
    work.mkdir()
    args = ["--device", "cpu", "--params", "3e6", "--every", "30", "--workdir", str(work), "--json", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "bench", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # one line per part when the output is not a terminal
            if "throughput, round 1" in line:
                break
        else:
            pytest.fail(f"the bench ended early: {proc.wait()} {proc.stderr.read() if proc.stderr else ''}")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()[-3000:] if proc.stderr else ""
    assert rc == 128 + signal.SIGTERM, err
    res = json.loads(out.read_text())["details"]
    assert res["parts_done"] == ["first-save"] and res["complete"] is False, (res["parts_done"], err)
    assert res["samples"]["smartckpt.first_lazy_loop_wait"][0] > 0
    left = sorted(str(p.relative_to(work)) for p in work.rglob("*"))
    assert left == [], f"the bench left files in its work directory: {left[:20]} {err}"
    assert not out.with_name(out.name + ".tmp").exists()


def test_gpu_check_runs_every_file_with_cuda_tests():
    """benchmarks/gpu_check.sh names the test files it runs on a GPU: a file with tests marked
    cuda that it does not name would never run anywhere."""
    root = Path(__file__).resolve().parents[1]
    script = (root / "benchmarks" / "gpu_check.sh").read_text()
    # the mark as code (a decorator, a parametrize mark, a pytestmark list), not inside a string
    used = re.compile(r"(?<![\"'])\bpytest\.mark\.cuda\b")
    marked = {p.name for p in (root / "tests").glob("test_*.py") if used.search(p.read_text())}
    assert marked, "no CUDA tests found"
    for name in marked:
        assert f"tests/{name}" in script, f"{name} has CUDA tests that gpu_check.sh does not run"


def test_gpu_check_refuses_a_step_it_does_not_have_in_one_line(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        ["bash", str(root / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out")],
        env={"PATH": "/usr/bin:/bin", "GPU_CHECK_STEPS": "tests warp_drive"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "gpu_check: GPU_CHECK_STEPS: no step 'warp_drive' (steps: tests step_cost loop_wait pinned bench throughput)"
    ]


def test_gpu_check_summary_reads_every_result_file_the_check_writes(tmp_path: Path) -> None:
    """The summary of a GPU check, from the result files its steps write (the format of
    benchmarks/results/): each step's figures are in it, a missing file is said as such."""
    from smartckpt_cli.bench.record import Record
    from smartckpt_cli.bench.result import BenchResult

    dev = {"type": "cuda", "name": "a GPU"}
    step = Record("step_cost", "python benchmarks/step_cost.py --device cuda", device=dev, torch="t")
    mode = {
        "pairs": 10, "step_ms_without": 1.8, "step_ms_with": 1.85, "steps_per_s_without": 555.0,
        "steps_per_s_with": 540.0, "overhead_median": 0.027, "overhead_iqr": [0.01, 0.04], "inside_us_per_step": 21.5,
    }  # fmt: skip
    step.add("api.overhead_pct", 2.7, "%", "api")
    step.details = {
        "ranks": 1,
        "model": {"layers": 8, "width": 1024, "batch": 256, "optimizer": "AdamW"},
        "api": mode,
    }
    step.write(tmp_path / "step_cost-gpu.json")
    loop = Record("loop_wait", "python benchmarks/loop_wait.py --model bench", device=dev, torch="t")
    for way, wait in (
        ("smartckpt_lazy", 3.0),
        ("dcp_async_staged", 9.0),
        ("smartckpt_eager", 40.0),
        ("dcp_in_call", 45.0),
    ):
        loop.add(f"{way}.wait_ms", wait, "ms", way)
        loop.add(f"{way}.background_ms", 1.0, "ms", way)
        loop.add(f"{way}.written_s", 2.5, "s", way)
    loop.details = {"model_description": "MLP of 100.7M parameters, batch 4096, AdamW"}
    loop.write(tmp_path / "loop_wait-gpu.json")
    bench = BenchResult(params=400_000_000, state_bytes=4_800_000_000, reps=1, device="cuda")
    bench.info = {"device_name": "a GPU", "torch": "t", "batch": 4096, "dcp_async_staging": "DefaultStager"}
    bench.add("smartckpt.first_lazy_loop_wait", 0.012)
    bench.add("torch.save+fsync", 9.5)
    bench.done = ["first-save"]
    bench.record("smartckpt bench --device cuda").write(tmp_path / "bench-gpu.json")
    (tmp_path / "steps.txt").write_text(
        "tests|0|60|120\nstep_cost|0|80|120\nloop_wait|0|100|150\nbench|124|300|300\n"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [sys.executable, str(root / "benchmarks" / "gpu_check_summary.py"), "--results", str(tmp_path),
         "--steps", str(tmp_path / "steps.txt"), "--device", "cuda", "--seconds", "460", "--budget", "480"],
        check=True, timeout=60,
    )  # fmt: skip
    summary = (tmp_path / "summary.md").read_text()
    assert "| bench | 124 | 300 | 300 |" in summary
    assert "no pytest.xml" in summary  # said, not guessed
    assert (
        "| API | MLP 8x1024, batch 256, AdamW | 1 | 10 | 1.800 | 1.850 | 0.973x | +2.70 % (+1.00 .. +4.00) | 21.5 |"
        in summary
    )
    assert "- zero-code: no figures in step_cost-gpu.json" in summary
    assert "| smartckpt_lazy | 3.0 ms | 1.0 ms | 2.500 s |" in summary
    assert "| dcp_in_call | 45.0 ms | 1.0 ms | 2.500 s |" in summary
    assert "**First save**: the loop waited 12.0 ms" in summary and "(cut short)" in summary
    assert "no throughput-gpu.json" in summary
