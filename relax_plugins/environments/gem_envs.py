"""``gem``: environments of the ``gem-llm`` library (``reset(seed) -> (observation, info)``,
``step(action) -> (observation, reward, terminated, truncated, info)``, made by id with
``gem.make("game:...")``, ``math:``, ``qa:``, ``rg:`` ...) as a Relax environment, with a data set of
their first observations.

A gem environment writes its own first observation (the game's instructions) from its seed, while a
Relax trajectory starts from its data row's prompt. So the ``gem`` data set's row ``i`` is the
environment's first observation for seed ``seed + i``, with that seed as the label
(``data.label_key: seed``); the ``gem`` environment makes the environment per trajectory, resets it
with the label's seed, checks that it starts from the row's prompt, and steps it with the model's
turn text. Step rewards are turn rewards (``roles.rollout.agent.turn_reward_weight``); ``terminated``
or ``truncated`` ends the trajectory. Seeding in gem is global (``random``, ``numpy``), so resets are
made one at a time.

gem-llm 0.1 pins ``msgspec`` and ``reasoning-gym`` against the project: it is installed in the
``envs`` test lane (``nox -s envs``), see docs/agents.md.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import AgentTask, Observation, ToolSpec, Turn

_RESET = threading.Lock()
"""gem seeds the process's global generators in ``reset``: one reset at a time."""


def _make(env_id: str, options: dict[str, Any]) -> Any:
    import gem
    from gem.envs.registration import ENV_REGISTRY

    if env_id not in ENV_REGISTRY:
        prefix = env_id.split(":")[0]
        near = sorted(k for k in ENV_REGISTRY if k.startswith(prefix))[:8]
        raise ValueError(f"gem has no environment {env_id!r}" + (f"; e.g. {', '.join(near)}" if near else ""))
    return gem.make(env_id, **options)


def _reset(env: Any, seed: int) -> str:
    with _RESET:
        observation, _ = env.reset(seed=seed)
    return str(observation)


class _GemOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    env: str = Field(min_length=1)
    """The gem id (``game:GuessTheNumber-v0-easy``, ``math:...``)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of ``gem.make`` (the environment's own options)."""


class GemDataset:
    """Row ``i``: the first observation of the environment reset with seed ``seed + i``."""

    columns: ClassVar[tuple[str, ...]] = ("prompt", "seed")

    class Config(_GemOptions):
        """Options of the gem data set."""

        size: int = Field(1024, ge=1)
        """Number of rows (seeds)."""
        seed: int = Field(0, ge=0)
        """The first row's seed."""

    @classmethod
    def length(cls, config: GemDataset.Config) -> int:
        return config.size

    def __init__(self, config: GemDataset.Config) -> None:
        self.config = config
        self.env = _make(config.env, config.options)

    def __len__(self) -> int:
        return self.config.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        seed = self.config.seed + int(index)
        return {"prompt": _reset(self.env, seed), "seed": seed}


class GemEnvironment:
    """One gem environment per trajectory, reset with the trajectory's seed."""

    class Config(_GemOptions):
        """Options of the gem environment (the same ``env`` and ``options`` as the data set's)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        _make(config.env, config.options)  # an unknown id is named at once

    def tools(self) -> list[ToolSpec]:
        return []

    def start(self, task: AgentTask) -> dict[str, Any]:
        try:
            seed = int(task.label)
        except (TypeError, ValueError):
            raise ValueError(f"the gem environment needs the row's seed as its label (data.label_key: seed, with the "
                             f"gem data set); got {task.label!r}") from None
        env = _make(self.config.env, self.config.options)
        first = _reset(env, seed)
        if not first.strip().startswith(task.prompt.strip()):  # the row may have been cut to max_prompt_tokens
            raise ValueError(f"gem environment {self.config.env!r} with seed {seed} does not start from the row's "
                             "prompt; give the gem data set the same env and options as the environment")
        return {"env": env}

    def step(self, state: dict[str, Any], turn: Turn) -> Observation:
        observation, reward, terminated, truncated, _ = state["env"].step(turn.text)
        return Observation(content=str(observation), role="user", reward=float(reward),
                           done=bool(terminated or truncated))

    def close(self, state: dict[str, Any] | None) -> None:
        env = (state or {}).pop("env", None)
        close = getattr(env, "close", None)
        if callable(close):
            close()
