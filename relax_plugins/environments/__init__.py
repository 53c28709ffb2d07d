"""Built-in ``relax.environments`` plugins: environments that answer a model's turns in multi-turn,
tool-using rollouts (``roles.rollout.agent.environment``)."""
