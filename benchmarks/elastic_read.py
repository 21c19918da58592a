"""What each rank reads when a checkpoint is restored at another world size (issue 21).

An FSDP2 model (``tests/scripts/elastic_train.py``: ``--layers`` layers of ``--width`` squared,
AdamW) trains at ``--save-ranks`` ranks (torchrun, gloo, CPU) and saves; then it is restored at
each of ``--restore-ranks``. Every rank logs what it read (``engine/reshard.py``: the encoded
bytes of the chunks it decoded) against what the checkpoint stores; the table gives each rank's
read as a share of the whole and against its fair share (1/M of it). A rank reads whole chunks
(``chunk_mb``), so where an old shard's boundary falls inside one it reads a little more.

    python benchmarks/elastic_read.py [--width 1024] [--layers 8] [--save-ranks 4] [--restore-ranks 1 2 3 8] [--chunk-mb 16]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import _record

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "elastic_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]


def run(nproc: int | None, args: list[str], cwd: Path, chunk_mb: int) -> str:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    env = {k: v for k, v in env.items() if not k.startswith("SMARTCKPT_")}
    env["SMARTCKPT_CHUNK_MB"] = str(chunk_mb)
    cmd = (
        [sys.executable, str(SCRIPT), "--single", *args]
        if nproc is None
        else [*TORCHRUN, str(nproc), str(SCRIPT), *args]
    )
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout + proc.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--save-ranks", type=int, default=4)
    ap.add_argument("--restore-ranks", type=int, nargs="+", default=[1, 2, 3, 8])
    ap.add_argument("--chunk-mb", type=int, default=16, help="the store's chunk size (the unit a rank reads)")
    ap.add_argument("--workdir", default=None)
    _record.add_json_argument(ap, "elastic_read")
    args = ap.parse_args()
    rec = _record.start("elastic_read")
    if args.width < 1 or args.layers < 0 or args.save_ranks < 1 or min(args.restore_ranks) < 1:
        ap.error("--width, --save-ranks and --restore-ranks must be positive")
    model = ["--width", str(args.width), "--layers", str(args.layers), "--info", "--save-every", "2"]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        run(args.save_ranks, [*model, "--dir", "ck", "--total", "2"], work, args.chunk_mb)
        print(
            f"FSDP2 MLP {args.layers + 2} layers, width {args.width}, AdamW; saved by {args.save_ranks} ranks "
            f"(chunk_mb {args.chunk_mb})\n"
        )
        print(
            f"{'restored on':>11}  {'rank':>4}  {'read MB':>8}  {'stored MB':>9}  {'share':>6}  {'vs 1/M':>6}  old parts read"
        )
        for m in args.restore_ranks:
            out = run(m, [*model, "--dir", "ck", "--total", "2"], work, args.chunk_mb)
            rows: dict[int, tuple[float, float, str]] = {}
            for line in out.splitlines():
                hit = re.search(
                    r"rank (\d+) read ([\d.]+) MB of ([\d.]+) MB stored(?: \(old parts \[([\d, ]*)\]\))?",
                    line,
                )
                if hit:
                    rows[int(hit[1])] = (float(hit[2]), float(hit[3]), hit[4] or "")
            if len(rows) != m:
                raise SystemExit(f"expected {m} read lines, found {len(rows)}:\n{out[-3000:]}")
            for r in range(m):
                read, stored, parts = rows[r]
                share = read / stored if stored else 0.0
                print(
                    f"{m:>11}  {r:>4}  {read:>8.1f}  {stored:>9.1f}  {share:>6.1%}  {share * m:>5.2f}x  {parts}"
                )
            most = max(rows[r][0] for r in range(m))
            stored = rows[0][1]
            who = f"restored on {m} rank(s)"
            rec.add(f"m{m}.read_mb", most, "MB", f"{who}: the most any rank read")
            rec.add(f"m{m}.share_pct", 100 * most / stored, "%", f"{who}: that, as a share of the checkpoint")
            rec.add(f"m{m}.vs_fair", most / stored * m, "x", f"{who}: that, against 1/M of the checkpoint")
            rec.details[f"m{m}"] = {str(r): rows[r] for r in range(m)}
        rec.add("stored_mb", stored, "MB", f"the checkpoint, saved by {args.save_ranks} ranks")
    rec.details.update(
        width=args.width, layers=args.layers + 2, save_ranks=args.save_ranks, chunk_mb=args.chunk_mb
    )
    rec.write(args.json)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
