"""The rollout's agentic sampler: a unit's prompts become multi-turn trajectories.

Built by the rollout loop when the plan has ``agent`` settings (``roles.rollout.agent``): the
environment plugin from the rollout's planned plugins (or the agent program behind the gateway),
the chat renderer over the backend's tokenizer, and the driver that runs one trajectory. Each
trajectory comes back as one ``Generation`` (with its loss mask and token versions) and one row of
metadata (``agent``: turns, tool calls, errors, truncation, turn reward), so from here on it is a
sample like any other: the ledger, staleness and restarts see no difference.
"""

from __future__ import annotations

from typing import Any

from relax.agents.chat import ChatTokens
from relax.agents.runner import AgentBatch, AgentLimits, EnvironmentDriver, run_trajectories
from relax.contracts import AgentTask, Generation, PluginKind
from relax.media import MediaSet, dumps_context, loads_context
from relax.plan.model import RoleWiring
from relax.runtime.components import build_planned
from relax.spec.models import AgentSpec


class AgentSampler:
    """Runs a unit's trajectories and hands them on as generations."""

    def __init__(self, agent: AgentSpec, wiring: RoleWiring, backend: Any, media: MediaSet | None,
                 telemetry: Any, max_new_tokens: int, max_prompt_tokens: int, dataset: Any) -> None:
        if not callable(getattr(backend, "generate_tokens", None)):
            raise TypeError(f"the rollout backend {type(backend).__name__} has no generate_tokens(prompts, sampling, "
                            "seed); agentic rollouts (roles.rollout.agent) need a backend that generates from token "
                            "ids (hf and vllm do)")
        self.agent, self.backend, self.media, self.dataset = agent, backend, media, dataset
        self.limits = AgentLimits(max_turns=agent.max_turns, max_tokens=agent.max_tokens,
                                  max_new_tokens=agent.max_new_tokens or max_new_tokens,
                                  tool_timeout_s=agent.tool_timeout_s, concurrency=agent.concurrency,
                                  tool_call_format=agent.tool_call_format, truncated=agent.truncated)
        encode_media = getattr(backend, "encode_text", None) if media is not None else None
        use = next((p for p in wiring.plugins if p.kind == PluginKind.environments), None)
        if use is not None:
            self.environment = build_planned(use)
            chat = ChatTokens(backend.tokenizer, list(self.environment.tools()), encode_media, max_prompt_tokens)
            self.driver: Any = EnvironmentDriver(self.environment, use.name, chat, self.limits,
                                                 version=lambda: int(backend.version), media=media,
                                                 telemetry=telemetry, prompt_media=self._prompt_media)
        else:
            from relax.agents.gateway import ProgramDriver

            self.driver = ProgramDriver(agent, backend, self.limits, version=lambda: int(backend.version),
                                        telemetry=telemetry, max_prompt_tokens=max_prompt_tokens)
        self._prompt_refs: dict[str, list[Any]] = {}
        """The media references of each running trajectory's prompt (multimodal data)."""

    def _prompt_media(self, task: AgentTask) -> list[Any]:
        return self._prompt_refs.get(task.trajectory_id, [])

    def sample(self, rows: list[dict[str, Any]], n: int, sampling: Any, seed: int, tag: str,
               first_group: int) -> tuple[list[Generation], list[dict[str, Any]], list[str] | None, AgentBatch]:
        """``n`` trajectories of each row (prompt-major): their generations, the ``agent`` metadata of
        each, their media contexts (every media item in token order; None for text runs) and the batch."""
        tasks = [AgentTask(prompt=row["prompt"], label=row["label"], row=dict(self.dataset[int(row["index"])]),
                           index=int(row["index"]), sample=j, trajectory_id=f"{tag}:{first_group + i}:{j}")
                 for i, row in enumerate(rows) for j in range(n)]
        self._prompt_refs = {task.trajectory_id: loads_context(rows[i // n]["media"])[1]
                             for i, task in enumerate(tasks) if "media" in rows[i // n]}
        try:
            batch = run_trajectories(tasks, self.driver,
                                     lambda prompts, s: self.backend.generate_tokens(prompts, sampling, s), seed)
        finally:
            self._prompt_refs = {}
        masked = self.limits.truncated == "mask"
        gens = [t.to_generation(prompt_index=i // n, masked=masked and t.truncated)
                for i, t in enumerate(batch.trajectories)]
        meta = [t.summary() for t in batch.trajectories]
        contexts = None
        if self.media is not None:
            contexts = [dumps_context(task.prompt, t.all_media, tokens_given=True)
                        for task, t in zip(tasks, batch.trajectories)]
        return gens, meta, contexts, batch

    def close(self) -> None:
        """Stop what the driver started (the gateway's endpoint); environments own no resources here."""
        close = getattr(self.driver, "close", None)
        if callable(close):
            close()
