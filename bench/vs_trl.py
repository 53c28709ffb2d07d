"""Relax against TRL's GRPOTrainer on the same work: steady s/step, whole-process time and reward.

    python bench/vs_trl.py [--steps 60] [--runs 2] [--modes separate async colocate]
                           [--trl defaults matched] [--keep DIR] [--venv DIR] [--skip 5]

A user who times Relax against a synchronous trainer on a small model compares these numbers, so
the bench measures both sides the way that user would, in one go, on one machine:

* **The work is built once** under a work folder (a temp dir, or ``--keep DIR``): the built-in
  ``builtin:tiny-lm`` copied out as a plain Hugging Face model folder (a Llama of hidden size 64,
  two layers, a byte-level tokenizer without chat template or BOS), and the ``synthetic:arithmetic``
  prompts of the tiny preset with their answers written to ``train.jsonl``. Both trainers load
  that folder and that file; the prompts reach both models as the same plain text (Relax's ``hf``
  rollout applies no chat template, and TRL applies one only to conversational prompts).
* **The work**: GRPO, 16 prompts x 8 samples a step, 8 new tokens, temperature 1.0, lr 1e-4, KL 0,
  one optimizer update per step, an exact-match reward on the answers (TRL calls Relax's own
  ``exact_match`` plugin, so both score alike); Relax with the ``hf`` rollout and the ``torch``
  trainer, TRL without vLLM on CPU, no eval, no saving, no reporting. Everything else is each
  side's default, as a user would run it. TRL runs twice per round: with its ``defaults`` (which
  on CPU mean bf16 autocast, gradient checkpointing and a linearly decaying learning rate) and
  ``matched`` to what Relax does (float32, no recomputed activations, a constant learning rate).
  The ratios are taken against ``matched``, the like-for-like run.
* **TRL never touches the project's environment**: it is installed once into its own virtualenv
  (``--venv``, default ``$RELAX_CACHE/bench-trl-venv`` or ``~/.cache/relax/bench-trl-venv``,
  made with ``--system-site-packages`` so it reuses the installed CPU torch and transformers) and
  run there as a subprocess, ``bench/trl_grpo_runner.py``.
* **Both sides are measured alike**, each run a fresh process: *steady s/step* is the median of the
  intervals between consecutive optimizer-step completions, leaving out the first ``--skip`` steps
  (TRL: a callback's ``on_step_end`` clock; Relax: ``time/step_s`` of ``metrics.jsonl``, the
  interval between the actor's step completions); *whole process* is the wall clock of the
  subprocess from spawn to exit (``relax run spec.yaml``, the TRL runner); *to 1st step* is the
  time from spawn to the end of the first step (Relax: ``startup.json``); *reward* is the mean
  reward of the last 10 steps. Relax runs in each of ``--modes``: ``separate`` (max_staleness 1,
  the preset's default), ``async`` (separate with max_staleness 2: the rollout may run two steps
  ahead) and ``colocate`` (on-policy); its start-up line is printed too.

It prints one table (medians over ``--runs`` with min-max) and the ratios Relax/TRL. It exits 0
whatever the numbers say (a bench reports, it does not judge) and fails loudly, with the tail of the
subprocess's output, when a side fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: TRL's release the bench measures, and the torch pin named in the same pip command so that pip
#: keeps the installed CPU torch instead of pulling a multi-GB CUDA build.
TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"
#: Packages that must never land in the bench's virtualenv (CUDA-linked, and nothing here needs them).
FORBIDDEN = ("torchvision", "torchaudio", "torchcodec")
VENV_MARKER = "relax-bench-trl.json"
RUNNER = Path(__file__).parent / "trl_grpo_runner.py"

#: The work of issue 17, the same on both sides.
PROMPTS_PER_STEP = 16
SAMPLES_PER_PROMPT = 8
MAX_NEW_TOKENS = 8
TEMPERATURE = 1.0
LEARNING_RATE = 1e-4
DATA_SIZE = 4096
REWARD_LAST = 10
"""The reward column averages the last this many steps."""
#: Relax's sides: placement mode and staleness bound. ``separate`` is the tiny preset's own (one
#: step of slack); ``async`` gives the rollout two, so its loop with the actor spans three steps.
MODES = {"separate": ("separate", 1), "async": ("separate", 2), "colocate": ("colocate", 0)}


# -- the numbers ---------------------------------------------------------------------------------


def step_intervals(end_times: list[float]) -> list[float]:
    """Per step, the time since the previous step completed (the first step has none, so the result
    is one shorter: entry i belongs to step i + 2, counting from 1)."""
    return [b - a for a, b in zip(end_times, end_times[1:])]


def steady_s_per_step(intervals_by_step: dict[int, float], skip: int) -> float:
    """The median step interval of the steps after the first ``skip`` (steps counted from 1), so
    model loading and warm-up stay out; fewer than 3 steady steps is an error, not a number."""
    steady = [s for step, s in sorted(intervals_by_step.items()) if step > skip]
    if len(steady) < 3:
        raise ValueError(f"only {len(steady)} steps after the first {skip}; run more --steps or lower --skip")
    return statistics.median(steady)


def spread(values: list[float], digits: int = 3) -> str:
    """``median (min-max)`` of a side's runs, or the single value of one run."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


# -- building the work ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Work:
    """The model folder and data file that both sides load."""

    root: Path
    model: Path
    data: Path


def build_work(root: Path) -> Work:
    """Copy ``builtin:tiny-lm`` out of Relax's model cache (building it there once) as a plain HF
    folder, and write the tiny preset's arithmetic problems with their answers as JSON lines."""
    from relax.contracts import PluginKind
    from relax.runtime.model_files import cache_dir
    from relax.runtime.worker.components import build_plugin
    from relax_plugins.datasets.arithmetic import ArithmeticDataset

    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    if not model.is_dir():
        cached = Path(build_plugin(PluginKind.models, "tiny-lm", {}).materialize(cache_dir()))
        shutil.copytree(cached, model, ignore=shutil.ignore_patterns("relax-build.json", "*.lock"))
    data = root / "train.jsonl"
    dataset = ArithmeticDataset(ArithmeticDataset.Config(size=DATA_SIZE))
    data.write_text("".join(json.dumps(dataset[i]) + "\n" for i in range(len(dataset))))
    return Work(root=root, model=model, data=data)


# -- TRL's own environment -----------------------------------------------------------------------


def default_venv() -> Path:
    from relax.runtime.model_files import cache_dir

    return Path(cache_dir()) / "bench-trl-venv"


def ensure_trl_venv(venv: Path) -> Path:
    """The python of a virtualenv holding TRL ``TRL_VERSION``: made once (``--system-site-packages``,
    so the installed CPU torch and transformers are reused) and reused while its marker matches."""
    python = venv / "bin" / "python"
    marker = venv / VENV_MARKER
    wanted = {"trl": TRL_VERSION, "torch": TORCH_VERSION}
    if python.exists() and marker.exists() and json.loads(marker.read_text()) == wanted:
        return python
    print(f"installing trl=={TRL_VERSION} into {venv} (once; about 1-2 minutes)", flush=True)
    if venv.exists():
        shutil.rmtree(venv)
    run_checked([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], "creating the TRL venv")
    run_checked([str(python), "-m", "pip", "install", "--quiet", f"trl=={TRL_VERSION}", f"torch=={TORCH_VERSION}"],
                "installing TRL")
    present = subprocess.run([str(python), "-m", "pip", "list", "--format=json", "--path",
                              site_packages(python)], capture_output=True, text=True, check=True)
    landed = sorted(p["name"] for p in json.loads(present.stdout) if p["name"].lower() in FORBIDDEN)
    if landed:
        raise SystemExit(f"installing TRL into {venv} pulled {', '.join(landed)}, which the bench must not "
                         f"install (CUDA-linked); remove {venv} and check trl=={TRL_VERSION}'s requirements")
    marker.write_text(json.dumps(wanted) + "\n")
    return python


def site_packages(python: Path) -> str:
    """The venv's own site-packages folder (not the system's it can also see)."""
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def run_checked(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed (exit {done.returncode}): {' '.join(command)}\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")


# -- one run of each side ------------------------------------------------------------------------


@dataclass
class RunResult:
    """What one run of one side measured."""

    s_per_step: float
    whole_s: float
    reward: float
    first_step_s: float
    """From spawning the process to the end of its first optimizer step."""
    startup: str = ""
    """Relax's own start-up line (its phases)."""


@dataclass
class Side:
    """Every run of one side (a row of the table)."""

    name: str
    runs: list[RunResult] = field(default_factory=list)

    def median(self, key: str) -> float:
        return statistics.median(getattr(r, key) for r in self.runs)

    def values(self, key: str) -> list[float]:
        return [getattr(r, key) for r in self.runs]


def timed(command: list[str], log: Path, what: str, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> tuple[float, float]:
    """Run ``command`` as a fresh process, its output to ``log``: ``(seconds from spawn to exit,
    wall clock at spawn)``. A failure stops the bench with the tail of the output."""
    with log.open("w") as out:
        spawned_at = time.time()
        start = time.perf_counter()
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        elapsed = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{what} failed (exit {code}): {' '.join(command)}\n--- last lines of {log} ---\n"
                         f"{log.read_text()[-4000:]}")
    return elapsed, spawned_at


def relax_spec(work: Work, mode: str, steps: int, name: str, out_dir: Path) -> dict[str, Any]:
    """The tiny preset (``presets/tiny-cpu.yaml``, written out whole) with this bench's work pinned:
    the shared model folder and data file, lr 1e-4, KL 0, no checkpoints, no tracing. ``mode`` is a
    key of ``MODES``: the placement mode and ``max_staleness``."""
    from relax.config import load_spec_dict

    preset, _ = load_spec_dict("tiny-cpu", [f"name={name}"])
    spec = merged(preset, {
        "model": {"path": str(work.model)},
        "data": {"prompt_key": "prompt", "label_key": "answer"},
        "algorithm": {"name": "grpo", "prompts_per_step": PROMPTS_PER_STEP,
                      "samples_per_prompt": SAMPLES_PER_PROMPT, "kl_coef": 0.0},
        "rewards": [{"name": "exact_match", "weight": 1.0}],
        "roles": {"rollout": {"backend": "hf",
                              "sampling": {"temperature": TEMPERATURE, "top_p": 1.0, "max_new_tokens": MAX_NEW_TOKENS}},
                  "actor": {"backend": "torch", "optimizer": {"lr": LEARNING_RATE}}},
        "placement": {"mode": MODES[mode][0]},
        "async_policy": {"max_staleness": MODES[mode][1]},
        "trainer": {"steps": steps, "output_dir": str(out_dir), "checkpoint_every": 0},
        "tracing": {"exporter": "none"},
    })
    # replaced, not merged: the preset's synthetic source has options a file source does not take
    spec["data"]["train"] = {"source": "jsonl", "options": {"path": str(work.data)}}
    return spec


def compile_project() -> None:
    """Byte-compile the project's packages once, before any run, as installing a wheel does and as
    Python's first import of a source tree does by default. Both sides import them (TRL's runner
    takes Relax's ``exact_match``), and Relax's every process does. Where ``PYTHONDONTWRITEBYTECODE``
    is set (this project's CI machines set it) nothing would be cached, and each of a run's
    processes would compile Relax's sources again: about 0.3 s of CPU each, six processes a run,
    while TRL's own packages come compiled from pip."""
    import compileall

    root = Path(__file__).resolve().parents[1]
    for package in ("relax", "relax_plugins"):
        if not compileall.compile_dir(root / package, quiet=1):
            raise SystemExit(f"could not byte-compile {root / package}")


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` laid on it: nested mappings merge, anything else replaces."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def run_relax(work: Work, mode: str, steps: int, skip: int, index: int) -> RunResult:
    """One ``relax run spec.yaml`` in a fresh process."""
    import yaml

    name = f"relax-{mode}-{index}"
    out_dir = work.root / "runs" / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    spec = work.root / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(relax_spec(work, mode, steps, name, out_dir), sort_keys=False))
    log = work.root / f"{name}.log"
    whole, _ = timed([sys.executable, "-m", "relax", "run", str(spec)], log, f"relax run ({mode}, run {index})",
                     cwd=work.root)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if len(rows) != steps:
        raise SystemExit(f"relax run ({mode}) wrote {len(rows)} metrics rows for {steps} steps; see {log}")
    # Relax's clock starts at the process's creation (psutil), a hair after the spawn here.
    record = json.loads((out_dir / "startup.json").read_text())
    first_step = float(record["total_s"])
    # The line `relax run` prints ("relax run: start-up: X s to the first step (phases)"); its phases
    # from startup.json should the wording change.
    startup = next((line[line.index("start-up:"):].strip() for line in log.read_text().splitlines()
                    if "start-up:" in line),
                   f"start-up: {first_step:.1f} s ("
                   + ", ".join(f"{k} {v:.1f}" for k, v in record.get("phases_s", {}).items()) + ")")
    return RunResult(
        s_per_step=steady_s_per_step({int(r["step"]): float(r["time/step_s"]) for r in rows}, skip),
        whole_s=whole,
        reward=statistics.mean(float(r["reward/mean"]) for r in rows[-REWARD_LAST:]),
        first_step_s=first_step,
        startup=startup,
    )


def run_trl(work: Work, python: Path, config: str, steps: int, skip: int, index: int) -> RunResult:
    """One run of ``bench/trl_grpo_runner.py`` with the TRL venv's python, in a fresh process;
    ``config`` is ``defaults`` or ``matched`` (see ``TRL_CONFIGS``)."""
    name = f"trl-{config}-{index}"
    out = work.root / f"{name}.json"
    out.unlink(missing_ok=True)
    command = [str(python), str(RUNNER), "--model", str(work.model), "--data", str(work.data),
               "--out", str(out), "--output-dir", str(work.root / "runs" / name), "--steps", str(steps),
               "--prompts-per-step", str(PROMPTS_PER_STEP), "--samples-per-prompt", str(SAMPLES_PER_PROMPT),
               "--max-new-tokens", str(MAX_NEW_TOKENS), "--temperature", str(TEMPERATURE),
               "--lr", str(LEARNING_RATE), *(["--matched"] if config == "matched" else [])]
    # The project's packages come from this interpreter's path (the runner imports Relax's
    # exact_match); nothing of TRL goes the other way.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(Path(__file__).parents[1]),
                                                                  os.environ.get("PYTHONPATH", "")) if p))
    whole, spawned_at = timed(command, work.root / f"{name}.log", f"the TRL runner ({config}, run {index})",
                              env=env, cwd=work.root)
    record = json.loads(out.read_text())
    ends, rewards = record["step_end_s"], record["step_reward"]
    if len(ends) != steps or len(rewards) != steps:
        raise SystemExit(f"the TRL runner recorded {len(ends)} step ends and {len(rewards)} rewards for "
                         f"{steps} steps; see {work.root / (name + '.log')}")
    return RunResult(
        s_per_step=steady_s_per_step({i + 2: s for i, s in enumerate(step_intervals(ends))}, skip),
        whole_s=whole,
        reward=statistics.mean(rewards[-REWARD_LAST:]),
        first_step_s=record["first_step_end_wall"] - spawned_at,
    )


# -- the table -----------------------------------------------------------------------------------


#: TRL's configurations: its defaults as a user gets them (bf16 autocast, gradient checkpointing, a
#: linearly decaying learning rate), and matched to what Relax does (float32, no recomputed
#: activations, a constant learning rate): the like-for-like reference of the ratios.
TRL_CONFIGS = {"defaults": "defaults", "matched": "matched: fp32, no ckpt, const lr"}


def table(reference: Side, sides: list[Side]) -> str:
    """The sides' medians (min-max) and the ratios of each Relax side to ``reference``."""
    header = ("side", "steady s/step", "to 1st step s", "whole process s", f"reward (last {REWARD_LAST})",
              "s/step Relax/TRL", "whole Relax/TRL")
    rows = [header]
    for side in sides:
        ratio = side.name.startswith("Relax")
        rows.append((
            side.name,
            spread(side.values("s_per_step")),
            spread(side.values("first_step_s"), 1),
            spread(side.values("whole_s"), 1),
            spread(side.values("reward")),
            f"{side.median('s_per_step') / reference.median('s_per_step'):.2f}x" if ratio else "",
            f"{side.median('whole_s') / reference.median('whole_s'):.2f}x" if ratio else "",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of every run (default 60)")
    parser.add_argument("--runs", type=int, default=2, help="runs of each side; the table shows their median")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of steady s/step (default 5)")
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES),
                        help="Relax's sides to run (default all): separate (max_staleness 1), async (separate, "
                             "max_staleness 2), colocate")
    parser.add_argument("--trl", nargs="+", choices=tuple(TRL_CONFIGS), default=list(TRL_CONFIGS),
                        help="TRL's configurations to run (default both); the ratios are against matched "
                             "when it runs")
    parser.add_argument("--keep", type=Path, default=None,
                        help="build the work and keep every run's files under this folder (default a temp dir)")
    parser.add_argument("--venv", type=Path, default=None,
                        help="TRL's virtualenv (default $RELAX_CACHE/bench-trl-venv, made once)")
    args = parser.parse_args()
    if args.steps < args.skip + 3:
        parser.error(f"--steps {args.steps} leaves fewer than 3 steady steps after --skip {args.skip}")
    if args.runs < 1:
        parser.error("--runs must be at least 1")

    python = ensure_trl_venv((args.venv or default_venv()).expanduser().resolve())
    compile_project()
    load_before = os.getloadavg()[0]
    trl_sides = {config: Side(f"TRL {TRL_VERSION} ({TRL_CONFIGS[config]})") for config in args.trl}
    relax_sides = {mode: Side(f"Relax {mode}" + (f" (max_staleness {MODES[mode][1]})" if MODES[mode][1] else ""))
                   for mode in args.modes}
    with tempfile.TemporaryDirectory(prefix="relax-vs-trl-") as tmp:
        work = build_work((args.keep or Path(tmp)).resolve())
        print(f"work folder {work.root}: model {work.model.name}/, data {work.data.name} "
              f"({DATA_SIZE} arithmetic problems)", flush=True)
        # Interleaved, so a slow spell of the machine hits every side alike.
        for index in range(args.runs):
            for config, side in trl_sides.items():
                result = run_trl(work, python, config, args.steps, args.skip, index)
                side.runs.append(result)
                print(f"TRL {config} run {index}: {result.s_per_step:.3f} s/step, first step after "
                      f"{result.first_step_s:.1f} s, {result.whole_s:.1f} s in all, reward {result.reward:.3f}",
                      flush=True)
            for mode, side in relax_sides.items():
                result = run_relax(work, mode, args.steps, args.skip, index)
                side.runs.append(result)
                print(f"Relax {mode} run {index}: {result.s_per_step:.3f} s/step, first step after "
                      f"{result.first_step_s:.1f} s, {result.whole_s:.1f} s in all, reward {result.reward:.3f}",
                      flush=True)
    reference = trl_sides.get("matched") or trl_sides["defaults"]
    print()
    print(f"GRPO, {PROMPTS_PER_STEP} prompts x {SAMPLES_PER_PROMPT} samples, {MAX_NEW_TOKENS} new tokens, "
          f"lr {LEARNING_RATE:g}, {args.steps} steps; steady s/step leaves out the first {args.skip} steps; "
          f"median (min-max) of {args.runs} run(s) each; ratios against {reference.name}")
    print(table(reference, [*trl_sides.values(), *relax_sides.values()]))
    # Both sides share the machine with whatever else runs: a load above the CPU count skews them.
    print(f"machine: {os.cpu_count()} CPUs, 1-minute load average {load_before:.1f} before the runs, "
          f"{os.getloadavg()[0]:.1f} after")
    for side in relax_sides.values():
        for index, result in enumerate(side.runs):
            print(f"{side.name} run {index}: {result.startup}")


if __name__ == "__main__":
    main()
