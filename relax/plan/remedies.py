"""Fixes the planner offers, checked before they are offered.

A plan's note (too few cores for the mode, GPUs no role uses), a layout problem and a memory
problem come with a fix: command-line overrides that act on them. Unlike a rule's fix, which is one
obvious change, these are found by trying candidates in order of how little they change
(``first_fix``): a candidate is applied to the spec and kept when the spec then validates (the
rules, the runtime's rules) and plans (layout and memory) with no problem the spec did not already
have. Where a candidate brings a
problem whose own fix is known (colocate mode wants ``max_staleness`` 0), that fix is added and the
candidate tried again, a few rounds at most: the fix offered is the whole set, which passes as it is.

Pure data, like the rest of ``relax.plan``: no torch, no ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from relax.errors import SpecError, SpecIssue
from relax.spec.models import RunSpec

if TYPE_CHECKING:
    from relax.plan.model import Plan

#: Rounds of adding the fixes of the problems a candidate brings, before it is given up.
FOLLOW_ROUNDS = 4

Key = tuple[str, str]


def with_overrides(spec: RunSpec, fix: Sequence[str]) -> dict[str, Any]:
    """The spec as a plain dict (as ``relax config`` prints it) with ``key=value`` overrides set,
    each value read as YAML reads it (``0``, ``true``, ``null``, ``[a,b]``, text), as the command
    line does for the plain values fixes hold, and ``~key`` deleted."""
    raw = spec.model_dump(mode="json", exclude={"extends"})
    for item in fix:
        key, _, text = item.lstrip("+").partition("=")
        node = raw
        *parents, last = key.lstrip("~").split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if key.startswith("~"):
            node.pop(last, None)
        else:
            node[last] = yaml.safe_load(text) if text else None
    return raw


def _key(issue: SpecIssue) -> Key:
    return issue.path, issue.message


class FixFinder:
    """Tries fixes on one spec: the ``outcome`` of the spec with overrides applied, the
    ``first_fix`` of candidates that ``holds``. A fix is judged by what it changes: the problems
    the spec already has besides the one being fixed (its ``baseline``, such as a model folder
    without tokenizer files) may stay."""

    def __init__(self, spec: RunSpec, base_dir: Path, elsewhere: frozenset[str] = frozenset(), fixing: str = ""):
        self.spec = spec
        self.base_dir = base_dir
        self.elsewhere = elsewhere
        """Paths of other problems that a fix may leave as they are (the other roles over memory,
        while one role's memory is fixed): each has its own fix."""
        self.fixing = fixing
        """The path of the problem being fixed, where the spec itself has it: an issue there is
        never taken for one the spec may keep."""
        self._baseline: set[Key] | None = None

    def outcome(self, fix: Sequence[str], check_memory: bool = True) -> tuple[list[SpecIssue], Plan | None]:
        """What ``relax validate`` finds on the spec with ``fix`` applied (its shape, the rules, the
        runtime's rules, its layout and memory), and the plan (without fixes of its own) when it
        finds nothing. This machine's GPUs are left out: a plan is for the cluster the spec names,
        and a fix does not change the machine."""
        from relax.plan import make_plan
        from relax.spec.validate import validate_spec

        try:
            spec = validate_spec(with_overrides(self.spec, fix), base_dir=self.base_dir)
        except SpecError as exc:
            return exc.issues, None
        runtime = runtime_issues(spec, self.base_dir)
        if runtime:
            return runtime, None
        try:
            return [], make_plan(spec, base_dir=self.base_dir, check_memory=check_memory, remedies=False)
        except SpecError as exc:
            return exc.issues, None

    def baseline(self) -> set[Key]:
        """The problems of the spec as it is, outside the memory check (which fixes act on)."""
        if self._baseline is None:
            self._baseline = {_key(i) for i in self.outcome((), check_memory=False)[0]
                              if not self.fixing or i.path != self.fixing}
        return self._baseline

    def holds(self, fix: Sequence[str], accept: Callable[[Plan], bool] = lambda plan: True) -> tuple[str, ...] | None:
        """``fix``, grown by the fixes of the problems it brings (up to ``FOLLOW_ROUNDS``), when the
        spec then plans with no problem it did not have and ``accept`` takes the plan; else None."""
        grown = list(fix)
        for _ in range(FOLLOW_ROUNDS):
            issues, plan = self.outcome(grown)
            new = [i for i in issues if _key(i) not in self.baseline() and i.path not in self.elsewhere]
            if not new:
                return tuple(grown) if plan is None or accept(plan) else None
            # A fix that only asks for a bigger cluster is not followed: the fix offered uses the
            # cluster the spec has.
            more = [item for issue in new if issue.path != "cluster" for item in issue.fix if item not in grown]
            if not more or any(_undoes(item, grown) for item in more):
                return None
            grown += more
        return None

    def first_fix(self, candidates: Iterable[Sequence[str]],
                  accept: Callable[[Plan], bool] = lambda plan: True) -> tuple[str, ...]:
        """The first candidate that ``holds`` (as grown), or () when none does."""
        for candidate in candidates:
            found = self.holds(candidate, accept)
            if found is not None:
                return found
        return ()


def runtime_issues(spec: RunSpec, base_dir: Path) -> list[SpecIssue]:
    """The findings of ``RUNTIME_RULES`` (what today's runtime can run) on a spec that passed
    ``RULES``, after ``check_plugins`` has loaded the plugin classes they consult."""
    from relax.registry import get_registry
    from relax.spec.rules import RUNTIME_RULES, RuleContext, check_plugins

    ctx = RuleContext(registry=get_registry(), base_dir=base_dir)
    list(check_plugins(spec, ctx))
    return [issue for check in RUNTIME_RULES for issue in check(spec, ctx)]


def _undoes(item: str, fix: Sequence[str]) -> bool:
    """Whether ``item`` sets a key that ``fix`` already sets, to another value (following it would
    go round in a circle)."""
    key = item.partition("=")[0]
    return any(other.partition("=")[0] == key and other != item for other in fix)


# -- candidates ---------------------------------------------------------------------------------


def _smaller(value: int, steps: int = 4) -> list[int]:
    """``value`` halved, again and again (at least 1), for candidates that shrink a setting."""
    out: list[int] = []
    while len(out) < steps and value > 1:
        value = max(1, value // 2)
        out.append(value)
    return out


def _larger(value: int, steps: int = 3) -> list[int]:
    """``value`` doubled, again and again."""
    return [value * 2**i for i in range(1, steps + 1)]


def rollout_memory_remedy(spec: RunSpec) -> tuple[str, list[tuple[str, ...]]]:
    """What lowers a rollout engine's memory (its KV cache holds every sequence of its share of a
    step): more replicas to share the step (outside colocate mode, on GPUs), fewer prompts a step,
    shorter responses. The words, and the candidates in that order."""
    from relax.errors import overrides

    rollout, algo = spec.roles.rollout, spec.algorithm
    words, candidates = [], []
    if spec.placement.mode != "colocate" and rollout.gpus_per_replica and not rollout.partial:
        words.append("more rollout replicas to share each step's sequences (roles.rollout.replicas)")
        candidates += [overrides(roles__rollout__replicas=n) for n in _larger(rollout.replicas)]
    words.append("fewer prompts a step (algorithm.prompts_per_step)")
    candidates += [overrides(algorithm__prompts_per_step=n) for n in _smaller(algo.prompts_per_step)]
    words.append("shorter responses (roles.rollout.sampling.max_new_tokens)")
    candidates += [overrides(roles__rollout__sampling__max_new_tokens=n)
                   for n in _smaller(rollout.sampling.max_new_tokens)]
    if rollout.backend == "vllm":
        words.append(f"vllm takes at most roles.rollout.gpu_memory_utilization ({rollout.gpu_memory_utilization:g}) "
                     "of each GPU for them")
    return "the KV cache holds every sequence of a step: " + "; ".join(words), candidates


def trained_memory_remedy(spec: RunSpec, name: str, parallelism: frozenset[str],
                          sharding: str) -> tuple[str, list[tuple[str, ...]]]:
    """What lowers a trained (or forward-only) role's memory, for what its backend supports
    (its ``parallelism`` and ``memory_sharding`` traits): gradient checkpointing where the role has
    it, smaller micro-batches, tensor parallel, more GPUs where the backend shards over them or
    splits the model, shorter sequences; a backend that keeps a whole replica on each GPU is told
    so. The words, and the candidates in that order."""
    from relax.errors import override

    role = spec.trained_roles()[name]
    path = f"roles.{name}"
    words, candidates = [], []
    if getattr(role, "gradient_checkpointing", True) is False:
        words.append(f"gradient checkpointing ({path}.gradient_checkpointing)")
        candidates.append((override(f"{path}.gradient_checkpointing", True),))
    if role.micro_batch_size > 1:
        words.append(f"smaller micro-batches ({path}.micro_batch_size)")
        candidates += [(override(f"{path}.micro_batch_size", n),) for n in _smaller(role.micro_batch_size)]
    par = role.parallel
    splits = bool({"tp", "pp"} & parallelism)
    if "tp" in parallelism and role.gpus:
        words.append(f"more tensor parallel ({path}.parallel.tp)")
        candidates += [(override(f"{path}.parallel.tp", tp),) for tp in _larger(par.tp)
                       if role.gpus % (tp * par.pp * par.cp) == 0]
    if role.gpus and (splits or sharding != "none"):
        words.append(f"more GPUs to {'split the model' if splits else 'shard its state'} over ({path}.gpus)")
        candidates += [(override(f"{path}.gpus", n),) for n in _larger(role.gpus)]
    words.append("shorter responses (roles.rollout.sampling.max_new_tokens)")
    candidates += [(override("roles.rollout.sampling.max_new_tokens", n),)
                   for n in _smaller(spec.roles.rollout.sampling.max_new_tokens)]
    text = "lower it with " + "; ".join(words)
    if not splits and sharding == "none":
        text += (f"; backend '{role.backend}' keeps the whole model and its optimizer state on every GPU, which no "
                 "setting of it lowers: a backend that splits the model (megatron) does")
    return text, candidates


def judge_memory_remedy(spec: RunSpec) -> tuple[str, list[tuple[str, ...]]]:
    """A judge's weights are split over the GPUs of each reward worker."""
    from relax.errors import overrides

    per = spec.roles.reward.gpus_per_replica
    return ("split the judge over more GPUs per reward worker (roles.reward.gpus_per_replica)",
            [overrides(roles__reward__gpus_per_replica=n) for n in _larger(per)])


def colocate_fix() -> tuple[str, ...]:
    """The start of the move to colocate mode; ``FixFinder.holds`` adds what it needs besides
    (``max_staleness`` 0, one rollout engine, ...)."""
    from relax.errors import overrides

    return overrides(placement__mode="colocate")


def unused_gpu_candidates(spec: RunSpec, free: int, used_per_node: list[int]) -> list[tuple[str, ...]]:
    """Ways to use ``free`` unused GPUs, most useful first: more rollout replicas (outside colocate
    mode; for an elastic rollout, more it may grow to), a larger actor; failing those, a cluster
    without the spare GPUs (fewer nodes when whole nodes are unused, else fewer GPUs a node).
    ``used_per_node``: GPUs used on each node."""
    from relax.errors import overrides

    rollout, actor = spec.roles.rollout, spec.roles.actor
    candidates = []
    if spec.placement.mode != "colocate" and rollout.gpus_per_replica and free >= rollout.gpus_per_replica:
        more = free // rollout.gpus_per_replica
        if rollout.max_replicas is None:
            candidates.append(overrides(roles__rollout__replicas=rollout.replicas + more))
        else:  # elastic: the GPUs it may grow into stay free
            candidates.append(overrides(roles__rollout__max_replicas=rollout.replica_limit + more))
    if actor.gpus:
        candidates.append(overrides(roles__actor__gpus=actor.gpus + free))
    if rollout.max_replicas is not None:
        return candidates  # a smaller cluster would leave the elastic rollout no room to grow
    nodes_used = sum(1 for used in used_per_node if used)
    if 0 < nodes_used < len(used_per_node) and all(used_per_node[:nodes_used]):
        candidates.append(overrides(cluster__nodes=nodes_used))
    if len(set(used_per_node)) == 1 and used_per_node[0]:
        candidates.append(overrides(cluster__gpus_per_node=used_per_node[0]))
    return candidates


def layout_candidates(spec: RunSpec, path: str) -> list[tuple[str, ...]]:
    """Ways out of a layout problem at ``path`` (``relax.plan.placement``): a tensor-parallel group
    or a rollout engine that would span nodes made one a node holds (the largest such divisor of
    it first), or, for roles that do not fit, more nodes."""
    from relax.errors import override, overrides

    per_node, candidates = spec.cluster.gpus_per_node, []
    if path.endswith(".parallel.tp"):
        role = getattr(spec.roles, path.split(".")[1])
        candidates = [(override(path, d),) for d in range(min(role.parallel.tp, per_node), 0, -1)
                      if role.parallel.tp % d == 0]
    elif path == "roles.rollout.gpus_per_replica":
        par = spec.roles.rollout.parallel
        candidates = [overrides(roles__rollout__gpus_per_replica=d, roles__rollout__parallel__tp=d // par.pp)
                      for d in range(min(spec.roles.rollout.gpus_per_replica, per_node), 0, -1)
                      if d % par.pp == 0 and spec.roles.rollout.gpus_per_replica % d == 0]
    elif path == "cluster":
        candidates = [overrides(cluster__nodes=spec.cluster.nodes + n) for n in (1, 2, 4)]
    return candidates
