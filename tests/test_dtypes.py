"""Every dtype torch has, through every per-tensor pass: staging, health check, precision
policies, codec, hashing, verify, restore and export.

The dtypes are those the installed torch can create (``smartckpt_cli.state.dtypes.DTYPES``, discovered
at import), so a later torch's new dtype is covered here without editing this file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

import smartckpt_cli as sc
from smartckpt_cli.errors import UnsupportedValueError
from smartckpt_cli.state import precision
from smartckpt_cli.state.dtypes import DTYPES, all_finite, reducible
from smartckpt_cli.store import codec

ALL = list(DTYPES.values())
FLOAT8 = [d for d in ALL if d.is_floating_point and d.itemsize == 1]


def _names(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def test_the_table_holds_every_dtype_the_issue_names():
    want = {
        "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
        "float64", "complex64", "complex128",
    }  # fmt: skip
    assert want <= set(DTYPES)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "uint16",
        "uint32",
        "uint64",
    ):
        if hasattr(torch, name):
            assert name in DTYPES, name
    assert not {"qint8", "quint8", "qint32"} & set(DTYPES)  # quantized: refused, see below


def _values(d: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Finite, varied values of dtype ``d`` (random bytes for the types without arithmetic)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if d == torch.bool:
        return (torch.rand(shape, generator=g) > 0.5).to(d)
    if d.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.complex128).to(d)
    if d.is_floating_point and d.itemsize > 1:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(d)
    if d.is_floating_point:
        try:  # float8 variants: through float32 (e8m0 holds magnitudes only)
            return (torch.randn(shape, generator=g).abs() + 0.1).to(d)
        except (RuntimeError, NotImplementedError):
            pass  # float4 packs two values a byte and converts from nothing: raw bytes
    raw = torch.randint(
        0, 256, (n * torch.empty((), dtype=d).element_size(),), dtype=torch.uint8, generator=g
    )
    if d.is_floating_point:  # a 1-byte float format without conversions: no NaN encodings exist
        return raw.view(d).reshape(shape)
    return raw.view(d).reshape(shape)


class _AllDtypes(torch.nn.Module):
    """One buffer of every dtype, plus an empty, a zero-dim and a non-contiguous one of each."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        for i, d in enumerate(ALL):
            name = _names(d)
            self.register_buffer(f"b_{name}", _values(d, (3, 5), seed + i))
            self.register_buffer(f"e_{name}", _values(d, (0, 4), seed + i))
            self.register_buffer(f"z_{name}", _values(d, (), seed + i))
            self.register_buffer(f"t_{name}", _values(d, (6, 4), seed + i).t())  # non-contiguous


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _journal(path: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (path / "journal.jsonl").read_text().splitlines()]


def _on(device: str, model: torch.nn.Module) -> torch.nn.Module:
    """``model``'s buffers on ``device``; on CUDA, those of dtypes CUDA cannot hold are dropped."""
    for key in list(model._buffers):
        try:
            model._buffers[key] = model._buffers[key].to(device)
        except (RuntimeError, NotImplementedError):
            del model._buffers[key]
    return model


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("precision", ["exact", "bf16", "fp16"])
def test_a_buffer_of_every_dtype_round_trips_bitwise(tmp_path, precision, device):
    saved = _on(device, _AllDtypes(0))
    if device == "cpu":
        assert len(saved._buffers) == 4 * len(ALL)
    assert torch.float8_e4m3fn in {b.dtype for b in saved.buffers()}
    assert not saved.t_float32.is_contiguous()
    with sc.CheckpointManager(tmp_path, precision=precision, chunk_mb=1) as mgr:
        mgr.register(model=saved)
        handle = mgr.save(1, blocking=True)
        assert handle.error is None
    commit = [e for e in _journal(tmp_path) if e["event"] == "commit"]
    assert [c["health"] for c in commit] == ["ok"]  # computed for every dtype, without error
    back = _on(device, _AllDtypes(100))
    with sc.CheckpointManager(tmp_path, precision=precision) as mgr:
        mgr.register(model=back)
        assert mgr.restore() == 1
    for key, t in saved.state_dict().items():
        r = back.state_dict()[key]
        assert (r.dtype, r.shape, r.device) == (t.dtype, t.shape, t.device), key
        assert torch.equal(_bytes(r), _bytes(t)), f"{key} differs"
    # and the store verifies (every chunk decoded and hashed again by `smartckpt verify`)
    out = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "verify", str(tmp_path), "--all"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("dtype", [d for d in ALL if d.is_floating_point or d.is_complex], ids=_names)
def test_a_nonfinite_value_of_any_floating_dtype_marks_the_checkpoint_unhealthy(tmp_path, dtype):
    model = torch.nn.Module()
    bad = _values(dtype, (8,), 0)
    nan = _nan_of(dtype)
    if nan is None:
        pytest.skip(f"{dtype} has no NaN or inf encoding")
    bad[3] = nan
    model.register_buffer("w", bad)
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(model=model)
        mgr.save(1, blocking=True)
    assert [e["health"] for e in _journal(tmp_path) if e["event"] == "commit"] == ["nonfinite-weights"]


def _nan_of(dtype: torch.dtype) -> Any:
    for value in (float("nan"), float("inf")):
        try:
            t = torch.tensor(value).to(dtype)
        except (RuntimeError, NotImplementedError):
            return None
        if not torch.isfinite(t.to(torch.complex128 if dtype.is_complex else torch.float64)):
            return t
    return None


@pytest.mark.parametrize("dtype", FLOAT8, ids=_names)
def test_all_finite_agrees_with_torch_on_every_byte_pattern(dtype):
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    try:
        expect = torch.isfinite(patterns.to(torch.float32))
    except (RuntimeError, NotImplementedError):
        expect = torch.ones(256, dtype=torch.bool)  # float4: no inf/NaN encodings
    for i in range(256):
        assert all_finite(patterns[i : i + 1]) == bool(expect[i]), f"{dtype} pattern {i:#04x}"


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
)
def test_all_finite_finds_one_bad_value(dtype):
    t = torch.randn(1000, dtype=torch.complex128 if dtype.is_complex else torch.float64).to(dtype)
    assert all_finite(t)
    for bad in (float("nan"), float("inf"), -float("inf")):
        u = t.clone()
        u[777] = bad
        assert not all_finite(u)
        assert not all_finite(u[700:800:7])  # a non-contiguous view holding it
    assert all_finite(torch.empty(0, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("where", [0, (1 << 20) - 1, 1 << 20, 3 * (1 << 20) + 5])
def test_all_finite_checks_every_block_of_a_large_tensor(dtype, where):
    """The check runs a block of 2**20 values at a time (small temporaries): a bad value at either
    edge of a block, or in the short last one, is found."""
    t = torch.ones(3 * (1 << 20) + 6, dtype=dtype)
    assert all_finite(t)
    t[where] = float("nan")
    assert not all_finite(t)


@pytest.mark.parametrize("transform", ["bf16", "sqrt_fp16"])
@pytest.mark.parametrize("dtype", ALL, ids=_names)
def test_precision_transforms_touch_only_wider_floats(dtype, transform):
    t = (
        _values(dtype, (64,), 3).abs()
        if dtype.is_floating_point and dtype.itemsize > 1
        else _values(dtype, (64,), 3)
    )
    red = precision.reduce(t, transform)
    if reducible(dtype):
        assert dtype in (torch.float32, torch.float64)
        assert red.transform["kind"] == transform and red.stored.itemsize == 2
    else:
        assert red.transform == {"kind": "none"}
        assert red.stored.dtype == dtype and torch.equal(_bytes(red.stored), _bytes(t))


def test_a_rule_reducing_every_buffer_leaves_other_dtypes_exact(tmp_path):
    """A tier rule that puts the whole model in L2 at bf16: only float32/float64 are reduced."""
    saved = _AllDtypes(0)
    rules = [{"match": "model/*", "tier": "L2", "precision": "bf16"}]
    with sc.CheckpointManager(tmp_path, tiers=rules) as mgr:
        mgr.register(model=saved)
        mgr.save(1, blocking=True)
    back = _AllDtypes(100)
    with sc.CheckpointManager(tmp_path, tiers=rules) as mgr:
        mgr.register(model=back)
        assert mgr.restore() == 1
    reduced = []
    for key, t in saved.state_dict().items():
        r = back.state_dict()[key]
        assert r.dtype == t.dtype and r.shape == t.shape
        if torch.equal(_bytes(r), _bytes(t)):
            continue
        assert reducible(t.dtype), f"{key} ({t.dtype}) was changed"
        assert torch.allclose(r.double(), t.double(), rtol=1 / 128), key
        reduced.append(key)
    assert reduced  # the rule did reduce the wide floats


def test_a_quantized_tensor_is_refused_with_its_path(tmp_path):
    model = torch.nn.Module()
    model.register_buffer("q", torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8))
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(model=model)
        with pytest.raises(UnsupportedValueError, match="model/q"):
            mgr.save(1, blocking=True)


def _export(store: Any, out: Any, fmt: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "export", str(store), str(out), "--format", fmt,
         "--weights-only"],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip


def _exported(
    model: torch.nn.Module, tmp_path: Any, fmt: str
) -> tuple[subprocess.CompletedProcess[str], Any]:
    store = tmp_path / f"ck-{fmt}"
    with sc.CheckpointManager(store) as mgr:
        mgr.register(model=model)
        mgr.save(1, blocking=True)
    out = tmp_path / f"out.{fmt}"
    return _export(store, out, fmt), out


def test_export_to_torch_writes_every_dtype(tmp_path):
    saved = _AllDtypes(0)
    res, out = _exported(saved, tmp_path, "torch")
    assert res.returncode == 0, res.stdout + res.stderr
    back = torch.load(out, weights_only=True)
    for key, t in saved.state_dict().items():
        assert back[key].dtype == t.dtype and torch.equal(_bytes(back[key]), _bytes(t)), key


def test_export_to_safetensors_writes_what_it_can_and_names_what_it_cannot(tmp_path):
    from safetensors.torch import load_file

    from smartckpt_cli.ops.export import _safetensors_has

    has = [d for d in ALL if _safetensors_has(d)]
    lacks = [d for d in ALL if not _safetensors_has(d)]
    assert {torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.int64} <= set(has)
    model = _AllDtypes(0)
    for key in list(model._buffers):
        if model._buffers[key].dtype in lacks:
            del model._buffers[key]
    (tmp_path / "ok").mkdir()
    res, out = _exported(model, tmp_path / "ok", "safetensors")
    assert res.returncode == 0, res.stdout + res.stderr
    back = load_file(out)
    for key, t in model.state_dict().items():
        assert back[key].dtype == t.dtype and torch.equal(_bytes(back[key]), _bytes(t)), key
    if not lacks:
        return
    res, out = _exported(_AllDtypes(0), tmp_path, "safetensors")
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, lines
    assert (
        "dtype" in lines[0] and "--format torch" in lines[0] and any(_names(d) in lines[0] for d in lacks)
    ), lines
    assert not out.exists()


def test_the_control_planes_itemsize_table_matches_torch():
    """``smartckpt verify`` sizes chunks from this table without importing torch: it must know
    every dtype the installed torch can store, with torch's own element size."""
    for name, dtype in DTYPES.items():
        assert codec.itemsize(name) == dtype.itemsize, name
    with pytest.raises(ValueError, match="unknown dtype 'float3_e1m1'"):
        codec.itemsize("float3_e1m1")
