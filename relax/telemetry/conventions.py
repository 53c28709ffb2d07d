"""The names Relax gives its spans and their attributes: the contract between the runtime, the
trace files and ``relax trace``.

Span tree of one run (one trace)::

    relax.run                                   driver, whole run
    ├── relax.step  (step t)                    emitted by the controller, id derived from (trace, t)
    │   ├── relax.rollout.batch                 rollout worker: generating step t's samples
    │   │   └── relax.agent.turn                agentic runs: one model turn of one trajectory
    │   │       └── relax.agent.tool_call       the environment answering that turn
    │   ├── relax.weight_sync                   rollout loading / actor publishing weights
    │   ├── relax.reward.score                  reward worker
    │   ├── relax.forward                       reference / actor_fwd: one forward pass for log-probs
    │   ├── relax.advantage.compute             advantage worker
    │   ├── relax.actor.train_step              actor worker; linked to the rollout batches it consumed
    │   └── relax.checkpoint                    actor worker
    └── relax.step  (step t+1) ...

Every attribute Relax sets is named ``relax.<what>``; a keyword ``samples=8`` given to
``Telemetry.span`` or ``RoleSpan.set`` is recorded as ``relax.samples``.
"""

from __future__ import annotations

from typing import Final

RUN: Final = "relax.run"
"""The root span: the whole run, in the driver."""
STEP: Final = "relax.step"
"""One training step t, from the first role starting on it to the optimizer step."""
ROLLOUT_BATCH: Final = "relax.rollout.batch"
"""The rollout generating the samples of one step."""
REWARD_SCORE: Final = "relax.reward.score"
"""The reward plugins scoring one step's responses."""
ADVANTAGE_COMPUTE: Final = "relax.advantage.compute"
"""The advantage estimator over one step's rewards."""
TRAIN_STEP: Final = "relax.actor.train_step"
"""The policy update of one step (after its data arrived)."""
WEIGHT_SYNC: Final = "relax.weight_sync"
"""Publishing (actor) or loading (rollout) a policy version."""
FORWARD: Final = "relax.forward"
"""A forward-only role (``reference``, ``actor_fwd``) computing one step's log-probs; its
``relax.role`` names which."""
CHECKPOINT: Final = "relax.checkpoint"
"""Writing a checkpoint."""
EVALUATE: Final = "relax.evaluate"
"""The evaluation worker (or the rollout, ``trainer.eval.host``) evaluating one policy version on
the held-out prompts (``data.eval``)."""
AGENT_TURN: Final = "relax.agent.turn"
"""One model turn of an agentic trajectory (``relax.trajectory``, ``relax.turn``), from its
request to its tokens; nested in the rollout batch."""
AGENT_SEGMENT: Final = "relax.agent.segment"
"""Where a segment of an agentic trajectory starts (``relax.trajectory``, ``relax.segment``,
``relax.parent``): its first call, or a call that did not extend the conversation (the gateway's
``agent.history: segments``); linked to the segment it branched from."""
AGENT_TOOL_CALL: Final = "relax.agent.tool_call"
"""An environment call of an agentic trajectory (its tool calls after a turn, or ``start``)."""
FAULT: Final = "relax.fault"
"""A failure the controller handled (in the driver): which worker, why, and what it did
(``relax.action``: restart, resume, stop; ``relax.regenerated`` samples leased again)."""
SCALE: Final = "relax.scale"
"""Rollout replicas added or removed mid-run (``relax scale``)."""

#: The role each work span belongs to (``relax.weight_sync`` takes the caller's role).
ROLE_OF_SPAN: Final[dict[str, str]] = {
    ROLLOUT_BATCH: "rollout",
    AGENT_TURN: "rollout",
    AGENT_SEGMENT: "rollout",
    AGENT_TOOL_CALL: "rollout",
    REWARD_SCORE: "reward",
    ADVANTAGE_COMPUTE: "advantage",
    TRAIN_STEP: "actor",
    CHECKPOINT: "actor",
    EVALUATE: "rollout",
}
#: Spans that are a role's work (busy time); ``relax.run`` and ``relax.step`` only frame them.
WORK_SPANS: Final = frozenset({ROLLOUT_BATCH, REWARD_SCORE, ADVANTAGE_COMPUTE, TRAIN_STEP, WEIGHT_SYNC, CHECKPOINT,
                               FORWARD, EVALUATE})

# Span attributes.
ATTR_STEP: Final = "relax.step"
"""The training step the work is for (int)."""
ATTR_POLICY_VERSION: Final = "relax.policy_version"
"""The policy version used (rollout) or produced (actor)."""
ATTR_STALENESS: Final = "relax.staleness"
"""step - policy_version of the samples (the largest in a batch)."""
ATTR_SAMPLES: Final = "relax.samples"
"""Samples (rows) handled."""
ATTR_TOKENS: Final = "relax.tokens"
"""Tokens handled (the rollout's response tokens, the actor's trained tokens)."""
ATTR_BUS_BYTES: Final = "relax.bus_bytes"
"""Bytes put on or read from the bus."""
ATTR_ROLE: Final = "relax.role"
"""The role doing the work (on spans) or hosted by the process (on the resource)."""

# Resource attributes (one set per process).
RES_RUN: Final = "relax.run"
"""The run name."""
RES_SPEC_HASH: Final = "relax.spec_hash"
"""Hash of the validated spec, so traces of different specs are never mixed up."""
RES_VERSION: Final = "relax.version"
"""The Relax version."""


def relax_attributes(values: dict[str, object]) -> dict[str, object]:
    """``{"samples": 8, "relax.step": 1, "gen_ai.x": 2}`` -> keys without a dot get ``relax.``; ``None`` values go."""
    return {(k if "." in k else f"relax.{k}"): v for k, v in values.items() if v is not None}
