"""The evaluation worker's loop (``trainer.eval.host: own``): a rollout engine of its own that
evaluates the policy on ``data.eval`` and never generates training samples.

It waits for each due version (``Evaluator.next_due``) to be published, loads it from the object
store, evaluates it and posts the figures to ``RunState``, until it evaluated the final version.
Training never waits for it. When it falls behind (an evaluation longer than ``eval_every``
steps), it takes the newest version at its next turn: every evaluation is still of one named
version (``eval/version``), and the final one is always evaluated.
"""

from __future__ import annotations

from relax.contracts import PluginKind, RolloutContext
from relax.plan.model import RoleWiring
from relax.roles import EVALUATION, Role
from relax.runtime.worker.components import build_planned, build_plugin, build_scorer, planned_context, role_device
from relax.runtime.worker.evaluation import Evaluator, yield_cpu_to_training
from relax.runtime.worker.role_env import RoleEnv
from relax.runtime.worker.weight_channels import ObjectStoreWeights
from relax.telemetry import WEIGHT_SYNC


class EvaluationLoop:
    """Evaluates every due policy version on the held-out prompts, in a worker of its own."""

    role = Role.rollout
    """Its worker hosts the rollout role: a rollout's fault policy and restart budget apply."""

    def __init__(self, env: RoleEnv, wiring: RoleWiring) -> None:
        self.env = env
        backend = wiring.plugins[0]
        self.context: RolloutContext = planned_context(backend, env.model_path, role_device())
        self.backend = build_plugin(PluginKind.rollout, backend.name, backend.options, self.context)
        self.weights = ObjectStoreWeights(env)
        self.evaluator = Evaluator(env.settings, self.backend, build_planned(wiring.evaluation),
                                   build_scorer(wiring.evaluation_rewards), self.context.sampling)

    def run(self, start: int) -> int:
        """Evaluate from version ``start`` (the step this attempt of the run starts at), or after the
        last version evaluated (a worker restarted in place, a resumed run), through the final
        version; returns how many evaluations it made."""
        env, evaluator, steps = self.env, self.evaluator, self.env.settings.steps
        if self.context.device == "cpu":
            # This thread runs every evaluation (one torch thread on CPU, the plan's); the heartbeat
            # keeps its priority.
            yield_cpu_to_training()
        evaluator.skip_evaluated(env)
        made, target = 0, evaluator.next_due(max(evaluator.done)) if evaluator.done else start
        while True:
            version, weights = self.weights.wait(target, self.backend.version)
            if weights is not None:
                with env.telemetry.span(WEIGHT_SYNC, step=version, role=EVALUATION, policy_version=version), \
                        env.activity.busy(f"evaluation loads weights v{version}"):
                    self.backend.load_weights(weights, version)
            if evaluator.due(version):
                evaluator.run(env, version, version, EVALUATION)
                made += 1
            if version >= steps:
                return made
            target = evaluator.next_due(version)
