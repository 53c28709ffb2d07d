"""Helpers for testing plugins and runs end to end: the tiny preset with overrides, on a local Ray.

A plugin author checks a reward, a backend or an estimator in a real run with three lines::

    with local_ray():
        code, rows, printed = tiny_run(tmp_path, "my-reward", "rewards=[{name: my_reward}]")
    assert code == 0 and rows[-1]["reward/mean"] > 0

It imports ray and the runtime when called, never at import time.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Logical CPUs of a test Ray: TransferQueue's own actors need about 5 beyond the roles.
TEST_RAY_CPUS = 8


@contextlib.contextmanager
def local_ray(**options: Any) -> Iterator[None]:
    """A fresh local Ray for the block (runs inside it start and close their own bus and workers),
    on loopback like an embedded run's (``relax.runtime.driver.launch._loopback_node``): Ray otherwise
    finds its node address by connecting a UDP socket towards 8.8.8.8, an off-machine attempt
    (no packet leaves, but a test suite makes none), and listens on the machine's address."""
    import ray

    from relax.runtime.driver.launch import LOOPBACK, _loopback_node, lean_head_node

    options.setdefault("_node_ip_address", LOOPBACK)
    with lean_head_node(), _loopback_node():
        ray.init(address="local", num_cpus=TEST_RAY_CPUS, include_dashboard=False, log_to_driver=False, **options)
    try:
        yield
    finally:
        ray.shutdown()


def tiny_spec(out_dir: Path, name: str, *overrides: str, preset: str = "tiny-cpu") -> tuple[Any, Any, Path]:
    """``(spec, plan, base_dir)`` of a preset (3 steps, no tracing, output under ``out_dir/name``)
    with dotted ``overrides`` applied after those defaults."""
    from relax.config import load_spec
    from relax.config.redaction import attach
    from relax.plan import make_plan
    from relax.spec import validate_spec

    loaded = load_spec(preset, [f"name={name}", f"trainer.output_dir={Path(out_dir) / name}",
                                "trainer.steps=3", "tracing.exporter=none", *overrides])
    spec = attach(validate_spec(loaded.raw, base_dir=loaded.base_dir), loaded.redactions)
    return spec, make_plan(spec, base_dir=loaded.base_dir), loaded.base_dir


def tiny_run(out_dir: Path, name: str, *overrides: str, resume: bool = False,
             preset: str = "tiny-cpu") -> tuple[int, list[dict[str, Any]], str]:
    """Run a preset with overrides: ``(exit code, metrics.jsonl rows, progress printed)``."""
    from relax.runtime.driver.launch import run_spec

    spec, plan, base = tiny_spec(out_dir, name, *overrides, preset=preset)
    out = io.StringIO()
    code = run_spec(spec, plan, base_dir=base, resume=resume, stream=out)
    metrics = Path(out_dir) / name / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return code, rows, out.getvalue()


def teacher_forced_logprobs(model_path: str, prompt_ids: list[int], response: list[int]) -> list[float]:
    """``log p(response_t | prompt, response_<t)`` of the Hugging Face model in ``model_path``, one
    forward pass (float32): what a rollout's behaviour log-probs must equal for that model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    ids = torch.tensor([list(prompt_ids) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


def sample_train_batch(rows: int = 7, vocab: int = 99, seed: int = 0) -> Any:
    """A fixed ``TrainBatch`` for checking a trainer backend: ragged prompts and responses (left and
    right padding, varied lengths) of token ids in ``[3, vocab)``, behaviour log-probs and
    advantages, all drawn from ``seed``. 99 is the vocabulary of ``builtin:tiny-lm``."""
    import torch

    from relax.algo.batch import collate
    from relax.contracts import Generation

    g = torch.Generator().manual_seed(seed)
    gens = []
    for i in range(rows):
        prompt = torch.randint(3, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        response = torch.randint(3, vocab, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        logprobs = (-torch.rand(len(response), generator=g) * 5).tolist()
        gens.append(Generation(i, prompt, response, logprobs, ""))
    return collate(gens, torch.randn(rows, generator=g), pad_token_id=0)


#: Overrides of the fault-tolerance tests and ``bench/chaos.py``: the tiny preset in separate mode,
#: a checkpoint every 2 steps, traces on, and timeouts short enough to see recoveries in seconds.
FAULT_TEST_OVERRIDES = ("placement.mode=separate", "async_policy.max_staleness=1", "trainer.checkpoint_every=2",
                        "tracing.exporter=jsonl", "fault_tolerance.heartbeat_s=0.5",
                        "fault_tolerance.heartbeat_timeout_s=6", "fault_tolerance.wait_timeout_s=120",
                        "fault_tolerance.restart_timeout_s=60")


class LiveRun:
    """A ``relax run`` in a process of its own (its own embedded Ray, or joining ``cluster.address``),
    for tests and benchmarks that fail, hang or scale its workers while it trains::

        run = LiveRun(tmp_path, "chaos", "trainer.steps=12").start()
        run.wait_rows(3)
        run.kill_worker("rollout")          # kill -9 the worker hosting the rollout
        assert run.wait() == 0 and run.rows()[-1]["samples/produced"] == run.rows()[-1]["samples/consumed"]
    """

    def __init__(self, out_dir: Path, name: str, *overrides: str, preset: str = "tiny-cpu",
                 resume: bool = False, env: dict[str, str] | None = None) -> None:
        self.run_dir = Path(out_dir) / name
        self.args = [preset, f"name={name}", f"trainer.output_dir={self.run_dir}", *overrides]
        self.resume, self.env = resume, env
        self.process: Any = None
        self.log = Path(out_dir) / f"{name}.log"

    def start(self) -> LiveRun:
        import os
        import subprocess
        import sys

        command = [sys.executable, "-m", "relax", "run", *self.args, *(["--resume"] if self.resume else [])]
        with self.log.open("a") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **(self.env or {})})
        return self

    def rows(self) -> list[dict[str, Any]]:
        metrics = self.run_dir / "metrics.jsonl"
        if not metrics.exists():
            return []
        rows = []
        for line in metrics.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # the line being written right now
                break
        return rows

    def until(self, what: str, check: Any, timeout_s: float, poll_s: float = 0.2) -> Any:
        """Poll ``check()`` until it returns something true (returned); fails if the run ends first."""
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (found := check()):
                return found
            if self.process.poll() is not None:
                raise RuntimeError(f"the run ended (exit {self.process.returncode}) before {what}:\n{self.output()}")
            time.sleep(poll_s)
        raise TimeoutError(f"no {what} after {timeout_s:.0f} s:\n{self.output()}")

    def wait_rows(self, n: int, timeout_s: float = 300, poll_s: float = 0.2) -> list[dict[str, Any]]:
        """Block until metrics.jsonl has ``n`` step rows."""
        return self.until(f"{n} step rows", lambda: len(self.rows()) >= n and self.rows(), timeout_s, poll_s)

    def status(self, timeout_s: float = 120) -> dict[str, Any]:
        """The controller's ``GET /status`` (waits for the controller to be up)."""
        from relax.runtime.driver.control import ControlError, control_call

        def ask() -> Any:
            try:
                return control_call(self.run_dir, "GET", "/status", timeout_s=10)
            except ControlError:
                return None

        return self.until("a controller answering /status", ask, timeout_s)

    def worker(self, role: str) -> dict[str, Any]:
        """The first worker hosting ``role``, as ``/status`` describes it (holder, pid, node)."""
        return self.until(f"a ready worker hosting {role}", lambda: next(
            (w for w in self.status()["workers"] if role in w["roles"] and w["pid"]), None), 120)

    def signal_worker(self, role: str, signal: int, at_rows: int | None = None) -> dict[str, Any]:
        """Send ``signal`` to the process of the worker hosting ``role``; returns that worker, with
        ``signalled_at`` (``time.time()``). ``at_rows``: once metrics.jsonl has that many rows, seen
        within 10 ms (the worker is found first): a tiny step takes tens of ms, so a test that
        waited for rows and then looked the worker up could find the run finished."""
        import os
        import time

        found = self.worker(role)
        if at_rows is not None:
            self.wait_rows(at_rows, poll_s=0.01)
        found["signalled_at"] = time.time()
        os.kill(found["pid"], signal)
        return found

    def kill_worker(self, role: str, at_rows: int | None = None) -> dict[str, Any]:
        """``kill -9`` the worker process hosting ``role`` (``at_rows``: see ``signal_worker``)."""
        import signal

        return self.signal_worker(role, signal.SIGKILL, at_rows)

    def scale(self, replicas: int) -> dict[str, Any]:
        from relax.runtime.driver.control import control_call

        return control_call(self.run_dir, "POST", "/scale", {"rollout": replicas})

    def wait(self, timeout_s: float = 600) -> int:
        return self.process.wait(timeout=timeout_s)

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""
