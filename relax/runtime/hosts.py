"""Which worker processes a run has: one per planned bundle, and one per extra rollout replica.

Roles whose first instances share a bundle share a process and hand data over in memory; each
rollout instance past the first is a process of its own that only generates (it leases units of
rollout work, see ``relax.runtime.ledger``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from relax.plan.model import Plan, RoleInstance
from relax.roles import CRITIC_VALUES, MODEL_ROLES, OPTIONAL_ROLES, RANKED_ROLES, STEP_ROLES, Role
from relax.spec.models import RunSpec


@dataclass
class Host:
    """One role worker to start: the roles it hosts and the plan instance whose bundle it takes."""

    roles: list[Role]
    instance: RoleInstance
    threads: int
    replica: int = 0
    """0 for a worker that hosts the run's step loops; n > 0 for the n-th extra rollout replica."""
    ranks: dict[str, list[RoleInstance]] = field(default_factory=dict)
    """Every rank of each hosted model role that spans several processes (rank 0, this worker,
    first): the worker starts the others on their planned bundles (``relax.runtime.ranks``)."""

    @property
    def holder(self) -> str:
        """The worker's name in the run: its roles, and the replica number of an extra replica."""
        return "/".join(self.roles) + (f"#{self.replica}" if self.replica else "")


def run_roles(spec: RunSpec) -> list[Role]:
    """The roles of a run, in data order (the plan's names)."""
    optional = [name for name in OPTIONAL_ROLES if getattr(spec.roles, name) is not None]
    return [*STEP_ROLES, *optional]


def report_names(spec: RunSpec) -> list[str]:
    """The per-step reports the controller waits for: one per role loop (the critic has two)."""
    names = run_roles(spec)
    return names + ([CRITIC_VALUES] if spec.roles.critic is not None else [])


def plan_hosts(plan: Plan, roles: list[Role] | None = None) -> list[Host]:
    """One worker process per planned bundle: roles whose first instances share a bundle share a
    process (colocate's rollout and actor; a rollout and the scorer riding on it; reward and
    advantage), and hand data to each other in memory. A model role with several ranks is hosted
    by the worker of its rank 0, which starts the other ranks itself."""
    cores = os.cpu_count() or 2
    by_bundle: dict[tuple[str, int], list[RoleInstance]] = {}
    for role in roles or STEP_ROLES:
        first = plan.instances_of(role)[0]
        by_bundle.setdefault((first.pool, first.bundles[0]), []).append(first)
    replicas = plan.instances_of(Role.rollout)[1:] if Role.rollout in (roles or STEP_ROLES) else []
    extra_ranks = sum(len(plan.instances_of(role)) - 1 for role in RANKED_ROLES if role in (roles or STEP_ROLES))
    model_processes = (sum(1 for group in by_bundle.values() if MODEL_ROLES & {i.role for i in group})
                       + len(replicas) + extra_ranks)
    hosts = []
    for group in by_bundle.values():
        roles = [Role(i.role) for i in group]
        has_model = bool(MODEL_ROLES & set(roles))
        anchor = next((i for i in group if i.role == Role.actor), group[0])
        ranks = {role: plan.instances_of(role) for role in roles
                 if role in RANKED_ROLES and len(plan.instances_of(role)) > 1}
        hosts.append(Host(roles, anchor, max(1, cores // model_processes) if has_model else 1, ranks=ranks))
    threads = max(1, cores // model_processes)
    hosts += [Host([Role.rollout], instance, threads, replica=instance.rank) for instance in replicas]
    return hosts


