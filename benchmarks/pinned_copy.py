"""Device-to-host copy speed into each kind of staging buffer smartckpt uses (issue 42, item 5).

A tensor of ``--gb`` on the device is copied, ``--repeats`` times each, interleaved, into:

* a pageable host tensor (what staging without pinning gets);
* smartckpt's private staging buffer (``host_buffer``: the buffer's own pages registered with
  ``cudaHostRegister``);
* a RAM-tier slot: a file in /dev/shm mapped shared, registered the same way (``pin_region``),
  as ``engine/ramtier.py`` does for a state on a GPU;
* the same mapping unregistered.

Reported: GB/s of each (median) and each against the pageable copy. On the CPU (``--device cpu``,
no CUDA) the same copies are host to host: the script's smoke test, not a figure.

    python benchmarks/pinned_copy.py [--device cuda] [--gb 2] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/pinned_copy.py` from a checkout
    sys.path.insert(0, str(ROOT))

import _record  # noqa: E402
import torch  # noqa: E402

from smartckpt_cli.engine.hostmem import host_buffer, pin_region, unpin_region  # noqa: E402


def _shm_slot(nbytes: int) -> tuple[mmap.mmap, torch.Tensor, int]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="smartckpt-pinned-copy-", dir=base)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(path)
    t = torch.frombuffer(m, dtype=torch.uint8, count=nbytes)
    t.fill_(0)  # faulted in, as the RAM tier's preparing thread does
    return m, t, t.data_ptr()


def _time(dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=dst.is_pinned())
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=5)
    _record.add_json_argument(ap, "pinned_copy")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    n = int(args.gb * 1e9)
    rec = _record.start("pinned_copy", device)
    src = torch.ones(n, dtype=torch.uint8, device=device)
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.fill_(0)
    private = host_buffer(torch.Size([n]), torch.uint8, pin=device.type == "cuda")
    private.fill_(0)
    _map, slot, ptr = _shm_slot(n)  # the mappings stay open until the process ends
    _map2, slot_plain, _ = _shm_slot(n)
    pinned = device.type == "cuda" and pin_region(ptr, n)
    buffers = {
        "pageable": pageable,
        "private staging (registered)": private,
        "RAM slot in /dev/shm (registered)": slot,
        "RAM slot in /dev/shm (not registered)": slot_plain,
    }
    times: dict[str, list[float]] = {k: [] for k in buffers}
    for _ in range(args.repeats):
        for name, dst in buffers.items():  # interleaved: the machine's noise hits all alike
            times[name].append(_time(dst, src, device))
    base = statistics.median(times["pageable"])
    print(f"{'buffer':40} {'GB/s':>8} {'vs pageable':>12}   pinned")
    for name, ts in times.items():
        med = statistics.median(ts)
        gbs = n / med / 1e9
        print(f"{name:40} {gbs:8.2f} {base / med:11.2f}x   {buffers[name].is_pinned()}", flush=True)
        rec.add(f"gbps[{name}]", gbs, "GB/s", f"{name}: device-to-host copy speed, median")
        rec.add(f"speedup[{name}]", base / med, "x", f"{name}: against a pageable buffer")
    rec.details.update(gb=args.gb, repeats=args.repeats, slot_registered=pinned)
    if pinned:
        unpin_region(ptr)
    del slot, slot_plain
    rec.write(args.json)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
