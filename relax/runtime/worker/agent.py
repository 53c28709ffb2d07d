"""The rollout's agentic sampler: a unit's prompts become multi-turn trajectories.

Built by the rollout loop when the plan has ``agent`` settings (``roles.rollout.agent``): the
environment plugin from the rollout's planned plugins (or the agent program behind the gateway),
the chat renderer over the backend's tokenizer, and the driver that runs one trajectory. Each
trajectory comes back as one ``Generation`` (with its loss mask and token versions) and one row of
metadata (``agent``: turns, tool calls, errors, truncation, turn reward), so from here on it is a
sample like any other: the ledger, staleness and restarts see no difference. A trajectory whose
history branched (the gateway's segments) comes back as one row per segment: the earlier segments'
rows are ``linked`` to the last one's (same sample, ``segment`` in their metadata), which alone is
scored and counts in the advantage's group statistics; they share its reward and advantage.
"""

from __future__ import annotations

from typing import Any

from relax.agents.chat import ChatTokens
from relax.agents.failure_causes import FailureCauses
from relax.agents.runner import AgentBatch, AgentLimits, EnvironmentDriver, run_trajectories
from relax.agents.tool_calls import resolve_format
from relax.contracts import AgentTask, Generation, PluginKind
from relax.media import MediaSet, dumps_context, loads_context
from relax.plan.model import RoleWiring
from relax.runtime.worker.components import build_planned
from relax.spec.models import AgentSpec


class AgentSampler:
    """Runs a unit's trajectories and hands them on as generations."""

    def __init__(self, agent: AgentSpec, wiring: RoleWiring, backend: Any, media: MediaSet | None,
                 telemetry: Any, max_new_tokens: int, max_prompt_tokens: int, dataset: Any) -> None:
        from relax.registry import supports

        if not supports(backend, "rollout", "token_generation"):
            raise TypeError(f"the rollout backend {type(backend).__name__} has no generate_tokens(prompts, sampling, "
                            "seed); agentic rollouts (roles.rollout.agent) need a backend that generates from token "
                            "ids (hf and vllm do)")
        self.agent, self.backend, self.media, self.dataset = agent, backend, media, dataset
        self.limits = AgentLimits(max_turns=agent.max_turns, max_tokens=agent.max_tokens,
                                  max_new_tokens=agent.max_new_tokens or max_new_tokens,
                                  tool_timeout_s=agent.tool_timeout_s, concurrency=agent.concurrency,
                                  # auto: the format the model's chat template writes, for either driver
                                  tool_call_format=resolve_format(agent.tool_call_format, backend.tokenizer),
                                  truncated=agent.truncated,
                                  max_failed_frac=agent.max_failed_frac, regenerate_failed=agent.regenerate_failed)
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
        self.causes = FailureCauses()
        """The causes of this worker's failed trajectories (``relax.agents.failure_causes``)."""
        self._prompt_refs: dict[str, list[Any]] = {}
        """The media references of each running trajectory's prompt (multimodal data)."""

    def _prompt_media(self, task: AgentTask) -> list[Any]:
        return self._prompt_refs.get(task.trajectory_id, [])

    def sample(self, rows: list[dict[str, Any]], n: int, sampling: Any, seed: int, tag: str,
               first_group: int, detail: bool = False) -> tuple[list[Generation], list[dict[str, Any]],
                                                                list[str] | None, AgentBatch]:
        """``n`` trajectories of each row (prompt-major): their generations (one per segment, the
        last segment's last), the metadata of each (``agent``, and ``sample``: which of the prompt's
        samples it is), their media contexts (every media item in token order; None for text runs)
        and the batch. ``detail``: the metadata holds the tool calls and observations too (a step
        whose samples the run shows)."""
        tasks = [AgentTask(prompt=row["prompt"], label=row["label"], row=dict(self.dataset[int(row["index"])]),
                           index=int(row["index"]), sample=j, trajectory_id=f"{tag}:{first_group + i}:{j}")
                 for i, row in enumerate(rows) for j in range(n)]
        self._prompt_refs = {task.trajectory_id: loads_context(rows[i // n]["media"])[1]
                             for i, task in enumerate(tasks) if "media" in rows[i // n]}
        try:
            batch = run_trajectories(tasks, self.driver,
                                     lambda prompts, s: self.backend.generate_tokens(prompts, sampling, s), seed,
                                     self.limits.max_failed_frac)
        finally:
            self._prompt_refs = {}
        batch.stats.update(self.causes.note(batch.trajectories))  # printed once per cause, then counted
        # Segments per trajectory (a gateway call that did not extend its conversation starts one).
        batch.stats["agent_segments"] = sum(len(t.segments) + 1 for t in batch.trajectories) / max(
            len(batch.trajectories), 1)
        masked = self.limits.truncated == "mask"
        gens: list[Generation] = []
        meta: list[dict[str, Any]] = []
        contexts: list[str] | None = [] if self.media is not None else None
        for i, (task, t) in enumerate(zip(tasks, batch.trajectories)):
            segments = t.to_generations(prompt_index=i // n, masked=masked and t.truncated)
            gens += segments
            meta += [{"agent": t.linked_summary(s), "sample": i % n, "segment": s} for s in range(len(segments) - 1)]
            meta.append({"agent": t.summary(detail), "sample": i % n,
                         **({"segment": len(segments) - 1} if len(segments) > 1 else {})})
            if contexts is not None:  # segments come from the gateway, whose calls carry no media
                contexts += [dumps_context(task.prompt, [], tokens_given=True)] * (len(segments) - 1)
                contexts.append(dumps_context(task.prompt, t.all_media, tokens_given=True))
        return gens, meta, contexts, batch

    def close(self) -> None:
        """Stop what the driver started: the gateway's endpoint, or the environment's per-worker
        ``teardown``."""
        close = getattr(self.driver, "close", None)
        if callable(close):
            close()
