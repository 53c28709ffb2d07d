"""How long ``relax validate`` takes against a bare interpreter: on the tiny preset and on a 1,024-GPU spec.

The target: ``relax validate tiny-cpu`` within 0.3 s of ``python -c pass``. SPEC.md also promises
that validate and plan finish "in well under a second even for a 1,024-GPU spec" and import neither
torch, ray, vllm, megatron nor transformers. This script checks both the way a user meets them. It
writes a valid 128-node x 8-GPU spec (Qwen/Qwen3-30B-A3B, separate mode, a rollout of 64 engines x
8 GPUs with tp 8, an actor of 512 GPUs with tp 4, pp 4, ep 8, on a Ray cluster named by
``cluster.address``) to a temporary folder, then times, each run in a fresh subprocess:

    python -c pass                               the floor: interpreter start-up
    relax validate tiny-cpu                      the target: load, typed checks, every rule,
                                                 plugin options, this machine, the plan
    relax validate SPEC                          the same on 1,024 GPUs
    relax plan SPEC --format json                the full placement plan of SPEC

The commands take turns, round after round (a burst of load elsewhere slows them all alike), and
each keeps its best time. Each line gives that time, its difference and ratio to the bare
interpreter, the exit status and the heavy libraries the command imported; there should be none.

Every run reads and writes compiled bytecode in a cache folder of its own (``PYTHONPYCACHEPREFIX``,
in the temporary folder) that an untimed first round fills, so relax is timed as an installed copy
runs, not while compiling its sources (an environment with ``PYTHONDONTWRITEBYTECODE`` set would
otherwise recompile every relax module on every run: ``--as-is`` times that instead).

The spec asks for the ``vllm`` rollout and ``megatron`` train backends, which relax-rl registers.
When no installed plugin registers those names, light stand-ins (classes that declare tp/pp/ep
support and nothing else) are written next to the spec as a distribution and put on
``PYTHONPATH``, so the spec is valid and the time measured is that of the engine, not of an error
report. The script says which it used.

    python bench/validate_speed.py [--repeat 10] [--as-is]

Exit status 1 when a command fails or imports a heavy library, or the tiny preset misses the target.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from importlib.metadata import entry_points
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "ray", "vllm", "megatron", "transformers")

#: The issue's target: ``relax validate tiny-cpu`` at most this many seconds over a bare interpreter.
TARGET_S = 0.3

SPEC = """\
# 1,024 GPUs: 128 nodes x 8. Rollout 64 x 8 = 512 GPUs, actor 512 GPUs (dp 32 x tp 4 x pp 4, ep 8).
# cluster.address names a Ray cluster: without it, `relax validate` would look for the 1,024 GPUs on
# this machine. pp 4 (not 2) keeps the actor's estimated peak under the 80 GiB of a GPU.
name: bench-1024-gpus
model: {path: Qwen/Qwen3-30B-A3B, modalities: [text], dtype: bfloat16}
data:
  train: {source: "synthetic:arithmetic", options: {size: 4096}}
algorithm: {name: grpo, samples_per_prompt: 16, prompts_per_step: 512}
rewards:
  - {name: exact_match}
roles:
  rollout:
    backend: vllm
    replicas: 64
    gpus_per_replica: 8
    parallel: {tp: 8}
    sampling: {temperature: 1.0, max_new_tokens: 4096}
  actor:
    backend: megatron
    gpus: 512
    parallel: {tp: 4, pp: 4, ep: 8}
    micro_batch_size: 1
    gradient_checkpointing: true
    optimizer: {name: adamw, lr: 1.0e-6}
cluster: {address: "ray://head-node:10001", nodes: 128, gpus_per_node: 8, cpus_per_node: 128, gpu_memory_gb: 80}
placement: {mode: separate}
async_policy: {max_staleness: 2, correction: tis}
trainer: {steps: 1000, checkpoint_every: 100}
tracing: {exporter: none}
"""

STANDINS = '''\
"""Stand-ins for the vllm and megatron backends: enough for validate and plan, never run."""
from pydantic import BaseModel


class _Backend:
    modalities = frozenset({"text"})

    class Config(BaseModel):
        pass


class VllmStandIn(_Backend):
    parallelism = frozenset({"dp", "tp", "pp"})

    def __init__(self, config, context): ...
    def generate(self, prompts, n, sampling, seed): ...
    def load_weights(self, weights, version): ...


class MegatronStandIn(_Backend):
    parallelism = frozenset({"dp", "tp", "pp", "cp", "ep"})

    def __init__(self, config, context): ...
    def compute_logprobs(self, batch): ...
    def train_step(self, batch): ...
    def weights(self): ...
    def save(self, path): ...
    def load(self, path): ...
'''

#: Runs ``relax`` in-process and reports, on its last stderr line, the exit status and the heavy
#: libraries loaded by then.
PROBE = """
import json, runpy, sys
sys.argv = ["relax", *sys.argv[1:]]
code = 0
try:
    runpy.run_module("relax", run_name="__main__")
except SystemExit as exc:
    code = exc.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & %r)
print(json.dumps({"rc": code, "heavy": heavy}), file=sys.stderr)
""" % (set(HEAVY),)


def installed(group: str, name: str) -> bool:
    return any(ep.name == name for ep in entry_points(group=group))


def write_standins(folder: Path) -> None:
    info = folder / "relax_bench_standins-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: relax-bench-standins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""\
        [relax.rollout]
        vllm = relax_bench_standins:VllmStandIn

        [relax.trainer]
        megatron = relax_bench_standins:MegatronStandIn
        """))
    (folder / "relax_bench_standins.py").write_text(STANDINS)


def run_once(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd)
    return time.perf_counter() - start, result


def probe_report(result: subprocess.CompletedProcess) -> tuple[int, list[str]]:
    """Exit status and heavy imports of a probed run (its own exit status if the probe never
    reported, e.g. the interpreter failed to start)."""
    lines = result.stderr.strip().splitlines()
    try:
        report = json.loads(lines[-1])
        return int(report["rc"] or 0), report["heavy"]
    except (IndexError, ValueError, KeyError, TypeError):
        return result.returncode or 1, []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per command; the best is kept")
    parser.add_argument("--as-is", action="store_true",
                        help="run in this environment's bytecode setting (no private bytecode cache, no "
                             "warm-up round)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="relax-bench-") as tmp:
        folder = Path(tmp)
        spec = folder / "bench-1024-gpus.yaml"
        spec.write_text(SPEC)
        env = dict(os.environ)
        # the relax of this checkout, wherever the script is started from
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        if installed("relax.rollout", "vllm") and installed("relax.trainer", "megatron"):
            backends = "installed vllm and megatron plugins"
        else:
            write_standins(folder)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
            backends = "stand-in vllm/megatron plugins (not installed here)"
        if args.as_is:
            bytecode = f"as the environment says (PYTHONDONTWRITEBYTECODE={env.get('PYTHONDONTWRITEBYTECODE', 'unset')})"
        else:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = str(folder / "pycache")
            bytecode = "cached in a private folder, filled by an untimed first round"

        relax = [sys.executable, "-c", PROBE]
        commands = [
            ("python -c pass", [sys.executable, "-c", "pass"]),
            ("relax validate tiny-cpu", [*relax, "validate", "tiny-cpu"]),
            ("relax validate SPEC", [*relax, "validate", str(spec)]),
            ("relax plan SPEC --format json", [*relax, "plan", str(spec), "--format", "json"]),
        ]
        best = {label: float("inf") for label, _ in commands}
        last: dict[str, subprocess.CompletedProcess] = {}
        for round_ in range(args.repeat + (0 if args.as_is else 1)):
            for label, argv in commands:
                seconds, last[label] = run_once(argv, env, folder)
                if args.as_is or round_ > 0:
                    best[label] = min(best[label], seconds)

        print("tiny-cpu: the tiny preset. SPEC: 128 nodes x 8 GPUs = 1,024 GPUs, Qwen/Qwen3-30B-A3B, "
              f"separate mode ({backends})")
        print(f"best of {args.repeat} runs each, taking turns, each in a fresh interpreter ({sys.executable}); "
              f"bytecode {bytecode}\n")
        print(f"{'command':<32} {'best (s)':>9} {'- bare':>7} {'x bare':>7}  {'exit':>4}  heavy imports")
        bare = best["python -c pass"]
        failed = False
        for label, argv in commands:
            rc, heavy = probe_report(last[label]) if argv[:3] == relax else (last[label].returncode, [])
            failed |= rc != 0 or bool(heavy)
            print(f"{label:<32} {best[label]:>9.3f} {best[label] - bare:>+7.3f} {best[label] / bare:>7.2f}  "
                  f"{rc:>4}  {', '.join(heavy) or 'none'}")
            if rc:
                print(textwrap.indent(last[label].stderr.strip(), "    "))
        over = best["relax validate tiny-cpu"] - bare
        met = over <= TARGET_S
        print(f"\ntarget: relax validate tiny-cpu within {TARGET_S} s of bare python: "
              f"{'met' if met else 'MISSED'} ({over:.3f} s over)")
    return 1 if failed or not met else 0


if __name__ == "__main__":
    sys.exit(main())
