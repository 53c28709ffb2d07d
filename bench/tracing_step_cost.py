"""What tracing at sampling ratio 1.0 adds to the tiny preset's step time, side by side with it off.

    python bench/tracing_step_cost.py [--steps 30] [--skip 5] [--rounds 2]

Runs the tiny CPU preset (separate mode, max_staleness 1) alternately with ``tracing.exporter``
none and jsonl, ``--rounds`` times each, in one embedded Ray, and prints the median steady-state
step time of each and their ratio. Step times on a shared 2-core machine vary by several percent
between runs, so it also prints the bound from the spans themselves: spans per step times the
measured cost of one span (bench/tracing_overhead.py), over the step time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tiny_runs import run_tiny  # noqa: E402

#: Spans a tiny separate-mode step emits: rollout batch, weight load, reward, advantage, train
#: step, weight publish, the step span (checkpoints aside).
SPANS_PER_STEP = 7
#: Cost of one jsonl span measured by bench/tracing_overhead.py on these machines (median, µs).
JSONL_SPAN_US = 76.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    times: dict[str, list[float]] = {"none": [], "jsonl": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for exporter in ("none", "jsonl"):
                rows = run_tiny(f"{exporter}-{round_}", Path(tmp), [f"trainer.steps={args.steps}",
                                                                    f"tracing.exporter={exporter}"])
                times[exporter] += [r["time/step_s"] for r in rows[args.skip:]]
    ray.shutdown()
    off, on = statistics.median(times["none"]), statistics.median(times["jsonl"])
    print(f"tracing off : median step {off * 1000:.1f} ms over {len(times['none'])} steps")
    print(f"tracing on  : median step {on * 1000:.1f} ms over {len(times['jsonl'])} steps (jsonl, ratio 1.0)")
    print(f"measured overhead: {100 * (on / off - 1):+.1f}% (run-to-run noise here is several percent)")
    print(f"span-cost bound  : {SPANS_PER_STEP} spans x {JSONL_SPAN_US:.0f} us = "
          f"{SPANS_PER_STEP * JSONL_SPAN_US / 1000:.2f} ms per step = {100 * SPANS_PER_STEP * JSONL_SPAN_US / 1e6 / off:.2f}%")


if __name__ == "__main__":
    main()
