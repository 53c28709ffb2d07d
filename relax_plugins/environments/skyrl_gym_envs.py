"""``skyrl_gym``: an environment of the ``skyrl-gym`` library (``pip install 'relax[skyrl_gym]'``) as a
Relax environment: a ``BaseTextEnv`` made by id with ``skyrl_gym.make(id, env_config=..., extras=...)``
per trajectory, ``init`` at its start, ``step(action)`` per model turn, ``close`` at its end.

The trajectory's label is passed as skyrl-gym expects it, ``extras["reward_spec"]["ground_truth"]``
(with ``method: rule``), the data row as ``extras["extra_info"]``. The model's turn text is the
action (the library parses its own tool syntax, so the environment declares no Relax tools); the
step's ``observations`` (chat messages) become the observation, its ``reward`` the turn reward
(weighted by ``roles.rollout.agent.turn_reward_weight``), ``done`` ends the trajectory.

``env`` names a registered id (``gsm8k``, ``gsm8k_multi_turn``, ...) or, for an environment built in
code, ``package.module:Class`` (registered under that name on first use). skyrl-gym's calls are
synchronous: the rollout runs them on their own threads under ``tool_timeout_s`` and
``concurrency``, like every environment call.
"""

from __future__ import annotations

import threading
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import AgentTask, Observation, ToolSpec, Turn

_REGISTER = threading.Lock()


class SkyRLGymEnvironment:
    """One skyrl-gym environment instance per trajectory."""

    class Config(BaseModel):
        """Options of the skyrl-gym adapter."""

        model_config = ConfigDict(extra="forbid")

        env: str = Field(min_length=1)
        """A registered skyrl-gym id, or ``package.module:Class`` of a ``BaseTextEnv`` built in code."""
        env_config: dict[str, Any] = Field(default_factory=dict)
        """The environment's ``env_config``."""
        extras: dict[str, Any] = Field(default_factory=dict)
        """Extra ``extras`` keys for every trajectory (``max_turns``, ...), beside ``reward_spec`` and
        ``extra_info``."""

    def __init__(self, config: Config) -> None:
        import skyrl_gym

        self.config = config
        self.env_id = config.env
        with _REGISTER:
            if self.env_id not in skyrl_gym.registry:
                if ":" not in self.env_id:
                    known = ", ".join(sorted(skyrl_gym.registry))
                    raise ValueError(f"skyrl-gym has no environment {self.env_id!r}; registered: {known}; or give "
                                     "package.module:Class of a BaseTextEnv")
                skyrl_gym.register(id=self.env_id, entry_point=self.env_id)

    def tools(self) -> list[ToolSpec]:
        return []

    def start(self, task: AgentTask) -> dict[str, Any]:
        import skyrl_gym
        from omegaconf import OmegaConf

        extras = {**self.config.extras, "reward_spec": {"method": "rule", "ground_truth": task.label},
                  "extra_info": dict(task.row)}
        env = skyrl_gym.make(self.env_id, env_config=OmegaConf.create(self.config.env_config), extras=extras)
        prompt = [{"role": "user", "content": task.prompt}]
        returned, _ = env.init(prompt)
        if _texts(returned) != _texts(prompt):
            env.close()
            raise ValueError(f"skyrl-gym environment {self.env_id!r} rewrites the prompt in init(); Relax renders "
                             "the data row's prompt itself: put the prompt in the data instead")
        return {"env": env}

    def step(self, state: dict[str, Any], turn: Turn) -> Observation:
        out = state["env"].step(turn.text)
        messages = list(out.get("observations") or [])
        content = "\n".join(str(m.get("content", "")) for m in messages)
        role = str(messages[0].get("role", "user")) if messages else "user"
        return Observation(content=content, role=role, reward=float(out.get("reward") or 0.0),
                           done=bool(out.get("done")), info={"metadata": out.get("metadata") or {}})

    def close(self, state: dict[str, Any] | None) -> None:
        if state and state.get("env") is not None:
            state.pop("env").close()


def _texts(messages: Any) -> list[str]:
    return [str(m.get("content", "")) for m in messages or []]
