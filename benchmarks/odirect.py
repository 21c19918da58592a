"""Does O_DIRECT help smartckpt's blob writes on this machine? Interleaved runs of 16 MiB writes
(smartckpt's chunk size) with write + fsync, buffered vs O_DIRECT, on the directory given.

    python benchmarks/odirect.py --dir /path/on/the/target/disk --mb 512 --reps 5

It measures the disk alone: no tensor is involved, so ``--device`` (taken, as by every script
here) changes nothing but is checked like everywhere else.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import _common as C
import _record


def _write(path: str, buf: mmap.mmap, total: int, direct: bool) -> float:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        for _ in range(total // len(buf)):
            os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=".")
    p.add_argument("--mb", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    C.add_device_argument(p, "unused here: this measures the disk alone")
    _record.add_json_argument(p, "odirect")
    args = p.parse_args()
    C.device_of(args, p)
    rec = _record.start("odirect")
    buf = mmap.mmap(-1, 16 << 20)  # page-aligned, as O_DIRECT requires
    buf.write(os.urandom(16 << 20))
    total = args.mb << 20
    path = os.path.join(args.dir, "odirect-bench.bin")
    res: dict[str, list[float]] = {"buffered": [], "O_DIRECT": []}
    try:
        for _ in range(args.reps):
            res["buffered"].append(total / _write(path, buf, total, False) / 1e9)
            try:
                res["O_DIRECT"].append(total / _write(path, buf, total, True) / 1e9)
            except OSError as err:  # tmpfs and some filesystems refuse it (EINVAL)
                print(f"O_DIRECT refused here: {err}")
                break
    finally:
        if os.path.exists(path):
            os.remove(path)
    for name, vals in res.items():
        if vals:
            print(f"{name:9s} write+fsync: median {statistics.median(vals):.2f} GB/s over {len(vals)} runs")
            rec.add(
                f"{name}.gb_s",
                statistics.median(vals),
                "GB/s",
                f"{args.mb} MiB in 16 MiB writes + fsync, {name}, median of {len(vals)}",
            )
    rec.details.update(samples_gb_s=res, mb=args.mb)
    rec.write(args.json)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
