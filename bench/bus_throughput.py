"""Throughput of the bus: put and get, one big batched call versus several smaller ones.

Why: every bus call pays a fixed 2-4 ms of round trips, so how a role chunks its batches decides
whether the bus or the model is the bottleneck. This prints samples/s and MB/s side by side for
the same data moved in calls of different sizes, and checks every byte came back unchanged.

    python bench/bus_throughput.py                       # 1024 samples x 4 KiB, calls of 1024/100/1
    python bench/bus_throughput.py --samples 64 --sample-kib 4096 --chunks 64 8

Runs a local Ray (``num_cpus=8``) and a real TransferQueue in this process; about 15 s to start.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import ray
import torch

from relax.bus import Bus, RowMeta


@dataclass
class Measurement:
    """Best-of-N and median rates of one chunk size."""

    chunk: int
    put_s: list[float]
    get_s: list[float]


def _run_once(bus: Bus, data: torch.Tensor, chunk: int, tag: str) -> tuple[float, float]:
    partition = f"bench-{tag}"
    n = data.shape[0]
    meta = [RowMeta(policy_version=0, sample_id=str(i)) for i in range(n)]
    start = time.perf_counter()
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        bus.put(partition, {"payload": data[lo:hi], "idx": torch.arange(lo, hi)}, meta[lo:hi])
    put_s = time.perf_counter() - start

    got_payload: list[torch.Tensor] = []
    got_idx: list[torch.Tensor] = []
    start = time.perf_counter()
    for lo in range(0, n, chunk):
        size = min(chunk, n - lo)
        batch = bus.get(partition, ["payload", "idx"], task="bench", batch_size=size, timeout_s=60)
        got_payload.append(batch["payload"])
        got_idx.append(batch["idx"])
    get_s = time.perf_counter() - start

    order = torch.argsort(torch.cat(got_idx))
    if not torch.equal(torch.cat(got_payload)[order], data):
        raise SystemExit(f"data mismatch for chunk {chunk}: the bus returned different bytes")
    bus.clear(partition)
    return put_s, get_s


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=1024, help="rows moved per run")
    parser.add_argument("--sample-kib", type=int, default=4, help="payload per row, KiB (float32)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 100, 1], help="rows per put/get call")
    parser.add_argument("--repeats", type=int, default=3, help="runs per chunk size")
    parser.add_argument("--storage-units", type=int, default=1, help="TransferQueue SimpleStorage units")
    args = parser.parse_args()

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    bus = Bus.start(num_storage_units=args.storage_units)
    try:
        data = torch.randn(args.samples, args.sample_kib * 256, dtype=torch.float32)
        _run_once(bus, data[: min(64, args.samples)], min(64, args.samples), "warmup")
        results = []
        for chunk in args.chunks:
            runs = [_run_once(bus, data, chunk, f"{chunk}-{r}") for r in range(args.repeats)]
            results.append(Measurement(chunk, [p for p, _ in runs], [g for _, g in runs]))
    finally:
        bus.close()
        ray.shutdown()

    mb = data.numel() * data.element_size() / 1e6
    print(
        f"\n{args.samples} samples x {args.sample_kib} KiB = {mb:.1f} MB per run, "
        f"{args.storage_units} storage unit(s), best (median) of {args.repeats}"
    )
    header = (
        f"{'rows/call':>9} {'calls':>6} | {'put samples/s':>20} {'put MB/s':>16} | "
        f"{'get samples/s':>20} {'get MB/s':>16}"
    )
    print(header)
    print("-" * len(header))
    for m in results:
        calls = -(-args.samples // m.chunk)
        cells = []
        for times in (m.put_s, m.get_s):
            best, median = min(times), statistics.median(times)
            cells.append(f"{args.samples / best:>9.0f} ({args.samples / median:>8.0f})")
            cells.append(f"{mb / best:>6.1f} ({mb / median:>6.1f})")
        print(f"{m.chunk:>9} {calls:>6} | {cells[0]:>20} {cells[1]:>16} | {cells[2]:>20} {cells[3]:>16}")


if __name__ == "__main__":
    main()
