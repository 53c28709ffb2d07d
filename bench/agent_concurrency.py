"""A slow tool holds only its own trajectory: the rollout's wall time against the slowest
trajectory's and against the sum of all of them.

    python bench/agent_concurrency.py [--trajectories 16] [--sleep 1.0] [--turns 3]

Why: a multi-turn rollout where one trajectory's tool call stalls the whole batch is as slow as its
slowest tool times the number of turns, the pitfall users report in other engines. Here every
trajectory advances on its own and the rollout batches the model calls of those that wait for it.

On the real ``hf`` rollout and the tiny omni model (its turns end by themselves), an environment
answers every turn; for half of the trajectories its first answer sleeps ``--sleep`` seconds. Side
by side in one run it measures:

- **together**: every trajectory in one ``run_trajectories`` call (what a rollout unit does);
- **alone**: each trajectory by itself, one after the other (the slowest of them, and their sum).

It prints the wall times and the ratios together / slowest-alone (close to 1: the slow tools
overlap with everything else) and together / sum-of-alone (far below 1).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from pydantic import BaseModel


class SleepyEnvironment:
    """Answers each turn with a short text; a trajectory of even sample number sleeps first."""

    class Config(BaseModel):
        sleep_s: float = 1.0
        turns: int = 3

    def __init__(self, config: "SleepyEnvironment.Config") -> None:
        self.config = config

    def tools(self) -> list:
        return []

    def start(self, task):
        return task.sample

    def step(self, state, turn):
        from relax.contracts import Observation

        if turn.index == 0 and state % 2 == 0:
            time.sleep(self.config.sleep_s)
        return Observation("go on", done=turn.index + 1 >= self.config.turns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--sleep", type=float, default=1.0)
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()

    import torch

    from relax.spec import validate_spec
    from relax.agents.chat import ChatTokens
    from relax.agents.runner import AgentLimits, EnvironmentDriver, run_trajectories
    from relax.contracts import AgentTask, PluginKind
    from relax.plan.contexts import rollout_context
    from relax.registry import get_registry

    torch.set_num_threads(1)
    registry = get_registry()
    cls = registry.load(PluginKind.models, "tiny-omni")
    cache = tempfile.mkdtemp(prefix="relax-agent-bench-")
    path = cls(cls.Config(warmup_steps=60, warmup_pool=12)).materialize(cache)
    spec = validate_spec({"name": "agent-bench", "model": {"path": path, "modalities": ["text", "image"]},
                          "data": {"train": {"source": "synthetic:omni"}, "media_keys": {"image": "image"}},
                          "roles": {"rollout": {"backend": "hf", "sampling": {"max_new_tokens": 12}}},
                          "tracing": {"exporter": "none"}})
    rollout = registry.load(PluginKind.rollout, "hf")(registry.build_config(PluginKind.rollout, "hf", {}),
                                                       rollout_context(spec, path))
    environment = SleepyEnvironment(SleepyEnvironment.Config(sleep_s=args.sleep, turns=args.turns))
    chat = ChatTokens(rollout.tokenizer, [], None, 128)
    limits = AgentLimits(max_turns=args.turns, max_tokens=400, max_new_tokens=12, tool_timeout_s=60,
                         concurrency=args.trajectories)
    driver = EnvironmentDriver(environment, "sleepy", chat, limits, version=lambda: 0)
    tasks = [AgentTask(prompt=f"What is {j}+1?", label=str(j + 1), row={}, index=j, sample=j,
                       trajectory_id=f"0:{j}:0") for j in range(args.trajectories)]

    def generate(prompts, seed):
        return rollout.generate_tokens(prompts, rollout.context.sampling, seed)

    run_trajectories(tasks[:2], driver, generate, 0)  # warm the template and the model
    started = time.perf_counter()
    together = run_trajectories(tasks, driver, generate, 1)
    together_s = time.perf_counter() - started
    alone = []
    for task in tasks:
        started = time.perf_counter()
        run_trajectories([task], driver, generate, 1)
        alone.append(time.perf_counter() - started)
    turns = sum(len(t.turns) for t in together.trajectories) / len(tasks)
    print(f"{args.trajectories} trajectories, {turns:.1f} turns each on average, half of them sleep "
          f"{args.sleep:g} s in their first tool call")
    print(f"together: {together_s:.2f} s wall, {together.stats['agent_generate_calls']:.0f} generate calls")
    print(f"alone:    slowest {max(alone):.2f} s, sum {sum(alone):.2f} s")
    print(f"ratio together / slowest alone: {together_s / max(alone):.2f}  (close to 1: slow tools hold only their own trajectory)")
    print(f"ratio together / sum of alone:  {together_s / sum(alone):.2f}")


if __name__ == "__main__":
    main()
