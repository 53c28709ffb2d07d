"""Does the bus cost what the bytes cost? A realistic step through the bus and through raw Ray.

    python bench/bus_throughput.py                     # the sizes below, 3 repeats each
    python bench/bus_throughput.py --sizes 8192x2048 --repeats 5

Why: a step's batch is rows x fields; a bus whose cost grows with rows x fields (one value, one
message part per row and field) turns a large step into seconds of overhead on GPUs, where the
model's own time per step is short. Each size moves one step of a rollout's columns -- ``input_ids``
(int64), ``rollout_logprobs`` (float32), ``loss_mask`` (bool), each ``[rows, tokens]``, ``lengths``
(``[rows, 2]``) and a media-reference column (one short JSON string per row) -- from this process
to a consumer actor in another process, two ways, side by side:

- **bus**: ``Bus.put`` here, ``Bus.get`` in the consumer (TransferQueue metadata, payload in Ray's
  object store, the keeper's copy: ``relax.bus.payloads``);
- **raw Ray**: ``ray.put`` of the same columns here, ``ray.get`` in the consumer: what moving the
  bytes costs with nothing on top.

It prints, per size, the median seconds of each way (put + get, end to end), MB/s, the bus's share
of raw Ray's throughput, and the bus's time per MB and per row x field across sizes: with a cost
that grows with bytes, time per MB stays flat while time per row x field does not. Every row is
checked to come back unchanged. Issue 17 asks for the bus to reach at least 50% of raw Ray's
throughput on the largest size.

The default sizes keep the bytes comparable while rows change 16x (8192x2048 and 512x32768) and
cut the bytes 8x at the same rows (8192x256). Needs about 3x the largest step in memory (~2 GB).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import ray
import torch

from relax.bus import Bus, RowMeta

FIELDS = ("input_ids", "rollout_logprobs", "loss_mask", "lengths", "media")


def make_step(rows: int, tokens: int, seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 151_000, (rows, tokens), generator=g),
        "rollout_logprobs": -torch.rand(rows, tokens, generator=g),
        "loss_mask": torch.rand(rows, tokens, generator=g) > 0.3,
        "lengths": torch.randint(1, tokens, (rows, 2), generator=g),
        "media": [json.dumps({"image": f"s3://bucket/images/{i:08d}.png", "audio": None}) for i in range(rows)],
    }


def nbytes(step: dict[str, object]) -> int:
    return sum(v.numel() * v.element_size() for v in step.values() if isinstance(v, torch.Tensor)) \
        + sum(len(s) for s in step["media"])


@ray.remote(num_cpus=0)
class Consumer:
    """The reading role, in its own process (as the actor reads what the rollout wrote)."""

    def __init__(self) -> None:
        self.bus = Bus.attach(timeout_s=60)

    def take_bus(self, partition: str, rows: int) -> tuple[float, str]:
        started = time.perf_counter()
        batch = self.bus.get(partition, list(FIELDS), task="actor", batch_size=rows, timeout_s=120)
        took = time.perf_counter() - started
        order = sorted(range(rows), key=lambda i: int(batch.meta[i].sample_id))  # TransferQueue may reorder
        if order != list(range(rows)):
            batch = batch.select(order)
        return took, _digest({name: batch[name] for name in FIELDS})

    def take_raw(self, refs: list) -> tuple[float, str]:
        started = time.perf_counter()
        step = ray.get(refs[0])
        took = time.perf_counter() - started
        return took, _digest(step)

    def close(self) -> None:
        self.bus.close()


def _digest(step: dict[str, object]) -> str:
    """A checksum of every value, so both ways prove they delivered the same bytes."""
    parts = []
    for name in FIELDS:
        value = step[name]
        if isinstance(value, torch.Tensor):
            parts.append(str(float(value.double().sum())))
        else:
            parts.append(hashlib.sha256("\n".join(value).encode()).hexdigest()[:16])
    return "|".join(parts)


def one_bus(bus: Bus, consumer: object, step: dict[str, object], rows: int, tag: str) -> tuple[float, str]:
    meta = [RowMeta(policy_version=0, sample_id=str(i)) for i in range(rows)]
    started = time.perf_counter()
    bus.put(tag, step, meta)
    put_s = time.perf_counter() - started
    get_s, digest = ray.get(consumer.take_bus.remote(tag, rows))
    bus.clear(tag)
    return put_s + get_s, digest


def one_raw(consumer: object, step: dict[str, object]) -> tuple[float, str]:
    started = time.perf_counter()
    ref = ray.put(step)
    put_s = time.perf_counter() - started
    get_s, digest = ray.get(consumer.take_raw.remote([ref]))
    del ref
    return put_s + get_s, digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["8192x2048", "512x32768", "8192x256"],
                        help="steps as ROWSxTOKENS")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sizes = [tuple(int(x) for x in s.lower().split("x")) for s in args.sizes]

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             object_store_memory=6 * 2**30)
    bus = Bus.start()
    consumer = Consumer.remote()
    results = []
    try:
        one_bus(bus, consumer, make_step(8, 16), 8, "warm-up")
        one_raw(consumer, make_step(8, 16))
        for rows, tokens in sizes:
            step = make_step(rows, tokens)
            bus_s, raw_s = [], []
            # One discarded round of each way at this size: the first step this large touches fresh
            # object-store pages (a median of 3 once read 1.8 s for the bus, against 0.39 s warm).
            one_bus(bus, consumer, step, rows, f"warm-{rows}x{tokens}")
            one_raw(consumer, step)
            for r in range(args.repeats):  # alternate, so drift on a shared machine hits both alike
                took, digest_bus = one_bus(bus, consumer, step, rows, f"bench-{rows}x{tokens}-{r}")
                bus_s.append(took)
                took, digest_raw = one_raw(consumer, step)
                raw_s.append(took)
                if digest_bus != digest_raw or digest_raw != _digest(step):
                    raise SystemExit(f"{rows}x{tokens}: the bus and raw Ray delivered different data")
            results.append((rows, tokens, nbytes(step), statistics.median(bus_s), statistics.median(raw_s)))
            del step
        ray.get(consumer.close.remote())
    finally:
        bus.close()
        ray.shutdown()

    print(f"\none step from this process to a consumer actor, median of {args.repeats} (put + get)")
    header = (f"{'rows x tokens':>14} {'MB':>7} | {'bus s':>7} {'bus MB/s':>9} | {'raw s':>7} {'raw MB/s':>9} | "
              f"{'bus/raw thru':>12} | {'bus ms/MB':>9} {'bus us/row*field':>16}")
    print(header)
    print("-" * len(header))
    for rows, tokens, size, bus_s, raw_s in results:
        mb = size / 1e6
        print(f"{f'{rows}x{tokens}':>14} {mb:>7.1f} | {bus_s:>7.3f} {mb / bus_s:>9.0f} | {raw_s:>7.3f} "
              f"{mb / raw_s:>9.0f} | {raw_s / bus_s:>11.0%} | {1e3 * bus_s / mb:>9.2f} "
              f"{1e6 * bus_s / (rows * len(FIELDS)):>16.2f}")


if __name__ == "__main__":
    main()
