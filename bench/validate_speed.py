"""How long ``relax validate`` and ``relax plan`` take on a 1,024-GPU spec, against a bare interpreter.

SPEC.md promises that both finish "in well under a second even for a 1,024-GPU spec" and import
neither torch, ray, vllm nor megatron. This script checks the promise end to end, the way a user
meets it: it writes a 128-node x 8-GPU spec (Qwen/Qwen3-30B-A3B, separate mode, a rollout of 64
engines x 8 GPUs with tp 8, an actor of 512 GPUs with tp 4, pp 2, ep 8) to a temporary file, then
times, best of 5 and each run in a fresh subprocess:

    python -c pass                              the floor: interpreter start-up
    python -m relax validate SPEC               load, typed checks, every rule, plugin options
    python -m relax plan SPEC --format json     (when relax.plan exists) the full placement plan

and prints each time with its ratio to the bare interpreter, plus the heavy libraries (torch, ray,
vllm, megatron, transformers) each command imported; there should be none.

The spec asks for the ``vllm`` rollout and ``megatron`` train backends. When no installed plugin
registers those names, light stand-ins (classes that declare tp/pp/ep support and nothing else)
are written next to the spec as a distribution and put on ``PYTHONPATH``, so the spec is valid and
the time measured is that of the engine, not of an error report. The script says which it used.

    python bench/validate_speed.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from importlib.metadata import entry_points
from pathlib import Path

HEAVY = ("torch", "ray", "vllm", "megatron", "transformers")

SPEC = """\
# 1,024 GPUs: 128 nodes x 8. Rollout 64 x 8 = 512 GPUs, actor 512 GPUs (dp 64 x tp 4 x pp 2, ep 8).
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
    parallel: {tp: 4, pp: 2, ep: 8}
    micro_batch_size: 1
    gradient_checkpointing: true
    optimizer: {name: adamw, lr: 1.0e-6}
cluster: {nodes: 128, gpus_per_node: 8, cpus_per_node: 128, gpu_memory_gb: 80}
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

PROBE = """
import json, runpy, sys
sys.argv = ["relax", *sys.argv[1:]]
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


def best_of(argv: list[str], repeat: int, env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    """Fastest wall time of ``repeat`` fresh runs, and the last run's result."""
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = subprocess.run(argv, capture_output=True, text=True, env=env)
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command; the best is kept")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="relax-bench-") as tmp:
        folder = Path(tmp)
        spec = folder / "bench-1024-gpus.yaml"
        spec.write_text(SPEC)
        env = dict(os.environ)
        if installed("relax.rollout", "vllm") and installed("relax.trainer", "megatron"):
            backends = "installed vllm and megatron plugins"
        else:
            write_standins(folder)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
            backends = "stand-in vllm/megatron plugins (not installed here)"

        commands = [("python -c pass", [sys.executable, "-c", "pass"])]
        commands.append(("relax validate SPEC", [sys.executable, "-c", PROBE, "validate", str(spec)]))
        if importlib.util.find_spec("relax.plan") is not None:
            commands.append(("relax plan SPEC --format json",
                             [sys.executable, "-c", PROBE, "plan", str(spec), "--format", "json"]))
        else:
            print("relax.plan does not exist yet: only validate is timed")

        print(f"spec: 128 nodes x 8 GPUs = 1,024 GPUs, Qwen/Qwen3-30B-A3B, separate mode ({backends})")
        print(f"best of {args.repeat} runs, each in a fresh interpreter ({sys.executable})\n")
        print(f"{'command':<32} {'best (s)':>9} {'x bare':>7}  {'exit':>4}  heavy imports")
        bare = None
        failed = False
        for label, argv in commands:
            seconds, result = best_of(argv, args.repeat, env)
            bare = bare or seconds
            rc, heavy = result.returncode, []
            if argv[1:2] == ["-c"] and argv[2] == PROBE:
                report = json.loads(result.stderr.strip().splitlines()[-1])
                rc, heavy = report["rc"], report["heavy"]
            failed |= rc != 0 or bool(heavy)
            print(f"{label:<32} {seconds:>9.3f} {seconds / bare:>7.2f}  {rc:>4}  {', '.join(heavy) or 'none'}")
            if rc:
                print(textwrap.indent(result.stderr.strip(), "    "))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
