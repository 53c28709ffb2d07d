"""Does a refactor change what a run computes? Seeded tiny runs, step by step, against a reference.

The deterministic layouts of the tiny preset (colocate, separate on-policy, and a PPO run with a
critic and a reference in hybrid mode) are run for a few steps; each step's data order, reward, loss
and grad norm is compared with ``bench/reference/same_numbers.json``, recorded before the change.

    python bench/same_numbers.py            # compare, print the largest differences, exit 1 on any
    python bench/same_numbers.py --record   # write the reference from this checkout

Float results are compared to a relative 1e-6: summation order may differ between layouts of the
same computation, nothing else may. Asynchronous layouts (max_staleness >= 1) are left out: which
policy version generates a batch there depends on timing.

The numbers hold on one machine only: the tiny model is built by training on the machine itself,
and another CPU's kernels round differently (on a second 2-core box every float differed from the
first step on, by up to 0.7% in the loss). The reference records the machine it was made on; on
another machine, record one from the commit before the change first, to a file of your own:

    git switch --detach BASE && python bench/same_numbers.py --record --reference /tmp/base.json
    git switch - && python bench/same_numbers.py --reference /tmp/base.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_runs import run_tiny  # noqa: E402

from relax.testing import local_ray  # noqa: E402

REFERENCE = Path(__file__).resolve().parent / "reference" / "same_numbers.json"
STEPS = 6
LAYOUTS = {
    "colocate": ["placement.mode=colocate", "async_policy.max_staleness=0"],
    "separate-k0": ["placement.mode=separate", "async_policy.max_staleness=0"],
    "hybrid-ppo": ["placement.mode=hybrid", "async_policy.max_staleness=0", "algorithm.name=ppo",
                   "algorithm.kl_coef=0.01", "roles.reference={backend: torch, gpus: 0}",
                   "roles.critic={backend: torch, gpus: 0}"],
}
KEYS = ("data/order", "reward/mean", "train/loss", "train/grad_norm", "staleness/max")
RELATIVE = 1e-6


def machine() -> dict[str, str]:
    """What the numbers depend on besides the code: the CPU (its model and instruction set) and torch."""
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else ():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first CPU's
    return {"cpu": fields.get("model name") or platform.machine(),
            "flags": hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:12],
            "torch": torch.__version__}


def measure() -> dict[str, list[dict]]:
    out = {}
    with tempfile.TemporaryDirectory() as root, local_ray():
        for name, overrides in LAYOUTS.items():
            rows = run_tiny(name, Path(root), [f"trainer.steps={STEPS}", "tracing.exporter=none", *overrides])
            out[name] = [{k: row.get(k) for k in KEYS} for row in rows]
    return out


def differences(reference: dict, measured: dict) -> list[str]:
    found = []
    for layout, rows in reference.items():
        got = measured.get(layout, [])
        if len(got) != len(rows):
            found.append(f"{layout}: {len(got)} steps, the reference has {len(rows)}")
            continue
        for step, (want, have) in enumerate(zip(rows, got), start=1):
            for key in KEYS:
                a, b = want.get(key), have.get(key)
                if isinstance(a, float) and isinstance(b, float):
                    if abs(a - b) > RELATIVE * max(abs(a), abs(b), 1e-12):
                        found.append(f"{layout} step {step} {key}: {b!r}, the reference has {a!r}")
                elif a != b:
                    found.append(f"{layout} step {step} {key}: {b!r}, the reference has {a!r}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="write the reference from this checkout")
    parser.add_argument("--reference", type=Path, default=REFERENCE,
                        help=f"the reference file to write or compare against (default: {REFERENCE})")
    args = parser.parse_args()
    if not args.record and not args.reference.is_file():
        print(f"no reference at {args.reference}: record one first (--record --reference {args.reference})")
        return 2
    here = machine()
    measured = measure()
    if args.record:
        args.reference.write_text(json.dumps({"machine": here, "layouts": measured}, indent=1) + "\n")
        print(f"wrote {args.reference}")
        return 0
    reference = json.loads(args.reference.read_text())
    recorded_on = reference.get("machine")
    found = differences(reference["layouts"], measured)
    steps = sum(len(rows) for rows in measured.values())
    print(f"{len(LAYOUTS)} layouts, {steps} steps compared on {', '.join(KEYS)}: "
          + ("identical to the reference" if not found else f"{len(found)} differences"))
    for line in found[:20]:
        print("  " + line)
    if found and recorded_on != here:
        print(f"the reference was recorded on another machine ({recorded_on or 'not recorded'}; this one: {here}):"
              " floats differ between machines. Record one from the commit before the change on this machine"
              " (--record --reference FILE, see this script's docstring) and compare against that.")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
