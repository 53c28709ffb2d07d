"""One module per role loop: what each role does for one training step, given the bus and the
run's control-plane service (``relax.runtime.worker.role_env.RoleEnv``).

A loop owns its plugin objects and does one step's work per call (``step``); a worker
(``relax.runtime.worker.workers.RoleWorker``) hosts one or more loops in one Ray process.

- ``rollout``: ``RolloutLoop`` generates and puts a step's samples;
- ``reward``: ``RewardLoop`` scores them (``rewards``);
- ``advantage``: ``AdvantageLoop`` estimates ``advantages`` (and the critic's ``returns``);
- ``actor``: ``ActorLoop`` trains, publishes weights and checkpoints;
- ``forward``: ``ForwardLoop``, the reference's ``ref_logprobs`` and actor_fwd's ``old_logprobs``;
- ``critic``: ``CriticValueLoop`` (``values``) and ``CriticTrainLoop``.
"""
