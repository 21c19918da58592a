"""Why smartckpt's zstd parameters for byte planes: default level-1 zstd against the tuned
parameters (min_match=7, hash_log=6) on the exponent plane of real-shaped fp32 weights.

    python benchmarks/codec_params.py [--device cpu|cuda]

The codec always works on host bytes (smartckpt copies device tensors to the host first);
``--device`` decides where the weights are initialised before that copy.
"""

from __future__ import annotations

import argparse
import time

import _common as C
import _record
import torch
import zstandard

from smartckpt_cli.state import precision
from smartckpt_cli.store import codec


def _best(fn, reps: int = 5) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_device_argument(p, "where the weights are initialised")
    _record.add_json_argument(p, "codec_params")
    args = p.parse_args()
    device = C.device_of(args, p)
    rec = _record.start("codec_params", device)
    torch.manual_seed(0)
    weight = torch.nn.Linear(4096, 4096, device=device).weight.detach().cpu()
    raw = precision.tensor_bytes(weight.contiguous())[: 16 << 20]
    plane = memoryview(codec.split_planes(raw, 4)[0]).cast("B")
    gb = len(plane) / 1e9
    variants = {
        "zstd level 1": zstandard.ZstdCompressor(level=1),
        "level 1, min_match=7, hash_log=6": zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters.from_level(1, min_match=7, hash_log=6)
        ),
    }
    for name, cctx in variants.items():
        t_enc, comp = _best(lambda c=cctx: c.compress(plane))
        dctx = zstandard.ZstdDecompressor()
        t_dec, _ = _best(lambda c=comp, d=dctx: d.decompress(c))
        print(
            f"{name:34s} ratio {len(comp) / len(plane):.3f}  encode {gb / t_enc:.2f} GB/s  decode {gb / t_dec:.2f} GB/s"
        )
        key = "default" if name == "zstd level 1" else "tuned"
        rec.add(f"{key}.ratio", len(comp) / len(plane), "x", f"{name}: compressed / raw exponent plane")
        rec.add(f"{key}.encode_gb_s", gb / t_enc, "GB/s", f"{name}: encode, best of 5")
        rec.add(f"{key}.decode_gb_s", gb / t_dec, "GB/s", f"{name}: decode, best of 5")
    rec.write(args.json)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
