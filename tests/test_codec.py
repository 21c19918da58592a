from __future__ import annotations

import numpy as np
import pytest
import torch

from smartckpt_cli.state import precision
from smartckpt_cli.store import codec


def _roundtrip_chunk(t: torch.Tensor, level: int = 1) -> tuple[str, torch.Tensor]:
    raw = precision.tensor_bytes(t.contiguous())
    name, enc = codec.encode_chunk(raw, t.element_size(), level)
    out = torch.empty_like(t)
    codec.decode_into(name, bytes(enc), precision.byte_view(out), t.element_size())
    return name, out


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
)
def test_chunk_roundtrip_is_exact(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(4096, generator=g) * 3).to(dtype)
    _, out = _roundtrip_chunk(t)
    assert torch.equal(out, t)


def test_shuffled_floats_compress_and_tiny_or_random_bytes_stay_raw():
    weights = torch.randn(100_000) * 0.02
    name, _ = _roundtrip_chunk(weights)
    assert name == "planes"
    enc_len = len(codec.encode_chunk(precision.tensor_bytes(weights), 4, 1)[1])
    assert enc_len < weights.numel() * 4 * 0.95
    assert _roundtrip_chunk(torch.randn(10))[0] == "raw"  # below the tiny threshold
    noise = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    assert _roundtrip_chunk(noise)[0] == "raw"  # incompressible: no zstd frame to decode later


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_join_planes_inverts_split_planes(itemsize):
    raw = np.random.default_rng(0).integers(0, 256, 8 * 1000, dtype=np.uint8)
    planes = codec.split_planes(memoryview(raw), itemsize)
    assert planes[0].dtype == np.uint8 and planes[0][0] == raw[itemsize - 1]  # little-endian top byte first
    out = np.full_like(raw, 0xAB)  # stale bytes everywhere: every byte must be rewritten
    codec.join_planes(planes, itemsize, out)
    assert np.array_equal(out, raw)
    half = np.full_like(raw, 0xAB)
    n = raw.size // itemsize
    codec.join_planes(planes, itemsize, half, n // 3, n // 2)  # a block touches only its elements
    assert np.array_equal(
        half[n // 3 * itemsize : n // 2 * itemsize], raw[n // 3 * itemsize : n // 2 * itemsize]
    )
    assert (half[: n // 3 * itemsize] == 0xAB).all() and (half[n // 2 * itemsize :] == 0xAB).all()


def test_decode_returns_the_raw_hash_across_block_boundaries():
    t = torch.randn(3 * (1 << 18) + 5) * 0.02  # several join blocks plus a ragged tail
    raw = precision.tensor_bytes(t)
    name, enc = codec.encode_chunk(raw, 4, 1)
    assert name == "planes"
    out = torch.empty_like(t)
    assert codec.decode_into(name, bytes(enc), precision.byte_view(out), 4) == codec.raw_hash(raw)
    assert torch.equal(out, t)


def _moments_with_extremes() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    # second-moment-like: log-uniform over ten decades, 1e-14 .. 1e-4
    v = 10 ** (torch.rand(50_000, generator=g) * 10 - 14)
    v[:5] = torch.tensor([1e-30, 1e-38, 3e-40, 0.0, 1e-20])  # deep underflow, subnormal, zero
    v[5] = 3e38  # near float32 max
    return v


@pytest.mark.parametrize("transform", ["bf16", "sqrt_fp16"])
def test_reduced_precision_never_turns_nonzero_into_zero_or_inf(transform):
    v = _moments_with_extremes()
    red = precision.reduce(v, transform)
    assert red.stored.element_size() == 2
    out = precision.expand(red.stored, red.transform, v.dtype, red.patch_index, red.patch_value)
    assert out.dtype == v.dtype
    assert int(((out == 0) & (v != 0)).sum()) == 0
    assert int(torch.isinf(out).sum()) == 0
    assert out[3] == 0  # a true zero stays zero
    nz = v != 0
    rel = ((out[nz] - v[nz]).abs() / v[nz]).max().item()
    assert rel < (2**-7 if transform == "bf16" else 2**-9)
    assert red.patch_index is not None  # the deep-underflow values went to the exact patch


@pytest.mark.parametrize("transform", ["bf16", "sqrt_fp16"])
def test_patch_stays_small_on_a_realistic_range(transform):
    v = _moments_with_extremes()
    v[5] = 1e-4  # no float32-max outlier: one power-of-two scale then fits the whole tensor
    red = precision.reduce(v, transform)
    assert red.patch_index is not None and red.patch_index.numel() < 0.01 * v.numel()


def test_plain_half_really_underflows_these_values():
    # The reason sqrt_fp16 exists: the seed's .half() zeroes most second moments.
    v = _moments_with_extremes()
    assert ((v.half() == 0) & (v != 0)).float().mean() > 0.3


def test_sqrt_fp16_keeps_exact_what_is_not_a_second_moment():
    t = torch.randn(1000)  # negative values: not a second moment
    red = precision.reduce(t, "sqrt_fp16")
    assert red.transform == {"kind": "none"} and torch.equal(red.stored, t)


def test_decode_rejects_wrong_length():
    t = torch.randn(10_000)
    name, enc = codec.encode_chunk(precision.tensor_bytes(t), 4, 1)
    out = np.empty(4 * 9_999, dtype=np.uint8)
    with pytest.raises(ValueError):
        codec.decode_into(name, bytes(enc), out, 4)


def test_encoded_pieces_are_the_blob_and_survive_until_the_next_chunk():
    """The writer hashes and writes the pieces without joining them; the planes live in the
    thread's reusable buffers, so they must equal the joined encoding at the time they are used,
    and the next, larger chunk grows them without disturbing the first blob."""
    g = torch.Generator().manual_seed(1)
    first = torch.randn(300_000, generator=g) * 0.02
    second = torch.randn(500_000, generator=g)
    name, parts = codec.encode_chunk_parts(precision.tensor_bytes(first), 4, 1)
    joined = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    assert name == "planes" and len(parts) > 1
    assert (name, joined) == (lambda r: (r[0], bytes(r[1])))(
        codec.encode_chunk(precision.tensor_bytes(first), 4, 1)
    )
    assert codec.parts_id(parts) == codec.blob_id(joined)
    codec.encode_chunk_parts(precision.tensor_bytes(second), 4, 1)  # reuses and grows the buffers
    out = torch.empty_like(first)
    assert codec.decode_into(name, joined, precision.byte_view(out), 4) == codec.raw_hash(
        precision.tensor_bytes(first)
    )
    assert torch.equal(out, first)
    # A chunk that stays raw is named by its raw hash: one hash pass, and verify re-hashes it.
    noise = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g)
    raw_name, raw_parts = codec.encode_chunk_parts(precision.tensor_bytes(noise), 1, 1)
    assert raw_name == "raw" and codec.parts_id(raw_parts) == codec.raw_hash(precision.tensor_bytes(noise))
