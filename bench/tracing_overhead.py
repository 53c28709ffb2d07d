"""Cost of Relax's tracing per span: disabled, in memory, and the jsonl file.

Why: every role wraps each unit of work in a span, and the rollout stamps a carrier on every row,
so tracing must stay far below the milliseconds a step's work takes. This prints microseconds per
span (a ``Telemetry.span`` with a step and three attributes, plus one ``set``), per carrier, and
per batch of links, best and median of several rounds.

    python bench/tracing_overhead.py                 # 20000 spans per round, 5 rounds
    python bench/tracing_overhead.py --spans 100000

The jsonl figure is the caller's time plus the final flush (the batch processor's thread writes
the file; on a 2-core machine it competes with the caller, so this is the whole cost).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from relax.telemetry import ROLLOUT_BATCH, JsonlSpanExporter, Telemetry, links_from


@dataclass
class Row:
    """The part of ``relax.bus.RowMeta`` that links use (importing the bus takes seconds)."""

    trace: dict[str, str]


def spans(tel: Telemetry, n: int) -> None:
    for step in range(n):
        with tel.span(ROLLOUT_BATCH, step=step, policy_version=step, staleness=0) as span:
            span.set(samples=8, tokens=1024)


def measure(make: Callable[[], Telemetry], n: int, rounds: int) -> list[float]:
    """Microseconds per span, one figure per round (a fresh Telemetry each round)."""
    figures = []
    for _ in range(rounds):
        tel = make()
        with tel.run_span():
            start = time.perf_counter()
            spans(tel, n)
            tel.flush()
            figures.append((time.perf_counter() - start) / n * 1e6)
        tel.shutdown()
    return figures


def bare_sdk_span() -> Callable[[], None]:
    """The same span straight from the SDK, for reference: what Relax's wrapper adds to it."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    tracer = provider.get_tracer("bench")

    def one() -> None:
        with tracer.start_as_current_span(ROLLOUT_BATCH, attributes={"relax.step": 1, "relax.role": "rollout",
                                                                     "relax.policy_version": 1,
                                                                     "relax.staleness": 0}) as span:
            span.set_attributes({"relax.samples": 8, "relax.tokens": 1024})

    return one


def measure_call(call: Callable[[], object], n: int, rounds: int) -> list[float]:
    figures = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            call()
        figures.append((time.perf_counter() - start) / n * 1e6)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=20_000, help="spans per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    n, rounds = args.spans, args.rounds
    folder = Path(tempfile.mkdtemp(prefix="relax-trace-bench-"))

    rows: list[tuple[str, list[float]]] = [
        ("span, exporter none", measure(lambda: Telemetry.disabled("rollout"), n, rounds)),
        ("span, in memory (simple processor)",
         measure(lambda: Telemetry("rollout", InMemorySpanExporter(), batch=False), n, rounds)),
        ("span, jsonl file (batch processor)",
         measure(lambda: Telemetry("rollout", JsonlSpanExporter(folder / "traces.jsonl")), n, rounds)),
    ]
    rows.append(("reference: bare SDK span, in memory", measure_call(bare_sdk_span(), n, rounds)))
    tel = Telemetry("rollout", InMemorySpanExporter(), batch=False)
    with tel.run_span(), tel.span(ROLLOUT_BATCH, step=0) as span:
        rows.append(("carrier() of a span", measure_call(span.carrier, n, rounds)))
        carrier = span.carrier()
    batch = [Row(trace=dict(carrier)) for _ in range(256)]
    assert len(links_from(batch)) == 1
    rows.append(("links_from 256 rows, 1 batch", measure_call(lambda: links_from(batch), n // 20, rounds)))
    lines = sum(1 for _ in (folder / "traces.jsonl").open())
    size = (folder / "traces.jsonl").stat().st_size

    print(f"{'':<38}{'best us':>10}{'median us':>11}")
    for name, figures in rows:
        print(f"{name:<38}{min(figures):>10.2f}{statistics.median(figures):>11.2f}")
    print(f"jsonl: {lines} lines, {size / lines:.0f} bytes per span")


if __name__ == "__main__":
    main()
