"""The run's vocabulary: roles and bus columns.

Every role name and every bus column is spelled once, here. Both are ``StrEnum``s, so a member
*is* its string (``Role.actor == "actor"``, ``{"actor": 1}[Role.actor]`` works, it pickles and
prints as the string): spec fields, report names, plan JSON and bus partitions keep their names.

Dependency-free on purpose: ``relax.plan`` (``relax plan``, no torch or ray) imports it as well as
the runtime.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """A role of a run (a block under ``roles`` in the spec; the plan's instance names)."""

    rollout = "rollout"
    reward = "reward"
    advantage = "advantage"
    actor = "actor"
    reference = "reference"
    critic = "critic"
    actor_fwd = "actor_fwd"


#: The roles every run has, in data order: a step goes rollout -> reward -> advantage -> actor.
STEP_ROLES: tuple[Role, ...] = (Role.rollout, Role.reward, Role.advantage, Role.actor)
#: Model roles a spec may add (each a block under ``roles``), in data order.
OPTIONAL_ROLES: tuple[Role, ...] = (Role.reference, Role.critic, Role.actor_fwd)
#: Roles that hold a model (the others score or estimate on CPU).
MODEL_ROLES: frozenset[Role] = frozenset({Role.rollout, Role.actor, *OPTIONAL_ROLES})
#: Model roles whose planned instances are the ranks of one model (not independent replicas).
RANKED_ROLES: tuple[Role, ...] = (Role.actor, *OPTIONAL_ROLES)

#: The report name (and bus task) of the critic's first loop, its values: a loop, not a role.
CRITIC_VALUES = "critic_values"
#: The evaluation worker (``trainer.eval.host: own``): a rollout engine of its own that only
#: evaluates on ``data.eval``. Its plan instance and loop go by this name; its worker hosts the
#: rollout role (a rollout's fault policy and budget), but takes no rollout work.
EVALUATION = "evaluation"


class Column(StrEnum):
    """A bus column: written by one role for every row of a step, read by others."""

    prompt = "prompt"
    response = "response"
    label = "label"
    input_ids = "input_ids"
    rollout_logprobs = "rollout_logprobs"
    lengths = "lengths"
    media = "media"
    """Per row, a multimodal sample's context (prompt text and media references) as JSON."""
    rewards = "rewards"
    advantages = "advantages"
    returns = "returns"
    values = "values"
    ref_logprobs = "ref_logprobs"
    old_logprobs = "old_logprobs"
    loss_mask = "loss_mask"
    """Agentic runs: 1 on the tokens the policy chose, 0 on observation and chat-template tokens."""
    token_versions = "token_versions"
    """Agentic runs: the policy version that chose each token (0 off the policy's tokens)."""
    routed_experts = "routed_experts"
    """MoE runs with ``algorithm.router_replay: r3``: per token, per MoE layer, the k experts the
    rollout's router chose for it (``relax.contracts.Generation.routed_experts``), ``[B, T, layers,
    k]`` in the smallest integer dtype, 0 off the response."""


#: Columns the rollout writes for every sample (``relax.runtime.worker.rows`` gives their layout; the
#: plan's bus fields list the same).
ROLLOUT_COLUMNS: tuple[Column, ...] = (Column.prompt, Column.response, Column.label, Column.input_ids,
                                       Column.rollout_logprobs, Column.lengths)
#: Token columns the rollout writes for agentic runs (``roles.rollout.agent``) and partial rollouts
#: (``roles.rollout.partial``), read by every role that reads tokens.
AGENT_COLUMNS: tuple[Column, ...] = (Column.loss_mask, Column.token_versions)
#: Token columns the rollout writes for rollout routing replay (``algorithm.router_replay: r3``),
#: read by the actor.
ROUTING_COLUMNS: tuple[Column, ...] = (Column.routed_experts,)
#: Columns the actor always reads.
TRAIN_COLUMNS: tuple[Column, ...] = (Column.input_ids, Column.rollout_logprobs, Column.lengths, Column.advantages)
#: Columns a role needs to rebuild a sample's tokens (reference, critic and actor_fwd read these).
TOKEN_COLUMNS: tuple[Column, ...] = (Column.input_ids, Column.lengths)
#: Token columns written by other roles than the rollout, attached to a ``TrainBatch`` when read.
OPTIONAL_TOKEN_COLUMNS: tuple[Column, ...] = (Column.ref_logprobs, Column.old_logprobs, Column.values, Column.returns)
