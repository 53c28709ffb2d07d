"""Plugins of every kind for Relax's own tests, registered by ``relax_testkit-0.1.dist-info``.

They follow the published contracts (``relax.contracts.HOOKS``) and declare the capabilities the
spec rules consult (``parallelism``, ``modalities``, ``group_based``), so rule tests do not depend
on what the built-in plugins happen to declare. Nothing here is run except ``FlakyCalculator``,
which the agentic runtime test runs (its workers see this distribution through ``PYTHONPATH``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

ALL_MODALITIES = frozenset({"text", "image", "audio", "video"})


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TestReward:
    """Reward 1.0 for every sample, plus a bonus."""

    class Config(_Options):
        bonus: float = Field(0.0, ge=0.0)
        """Added to every score."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def score(self, samples):
        return [1.0 + self.config.bonus for _ in samples]


class TestPrompts:
    """``size`` prompts "i+i"."""

    class Config(_Options):
        size: int = Field(16, ge=1)
        """Number of prompts."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def __len__(self) -> int:
        return self.config.size

    def __getitem__(self, index: int) -> dict:
        return {"prompt": f"{index}+{index}", "answer": str(2 * index)}


class TestRollout:
    """A rollout backend with tensor and pipeline parallelism and every modality."""

    parallelism = frozenset({"dp", "tp", "pp"})
    modalities = ALL_MODALITIES

    class Config(_Options):
        pass

    def __init__(self, config, context) -> None:
        self.config, self.context = config, context

    def generate(self, prompts, n, sampling, seed):
        raise NotImplementedError

    def load_weights(self, weights, version):
        raise NotImplementedError


class TextOnlyRollout(TestRollout):
    """A rollout backend that reads text only."""

    modalities = frozenset({"text"})


class TestTrainer:
    """A train backend with every kind of parallelism and every modality."""

    parallelism = frozenset({"dp", "tp", "pp", "cp", "ep"})
    modalities = ALL_MODALITIES

    class Config(_Options):
        pass

    def __init__(self, config, context) -> None:
        self.config, self.context = config, context

    def compute_logprobs(self, batch):
        raise NotImplementedError

    def train_step(self, batch):
        raise NotImplementedError

    def weights(self):
        raise NotImplementedError

    def save(self, path):
        raise NotImplementedError

    def load(self, path):
        raise NotImplementedError


class DataParallelTrainer(TestTrainer):
    """A train backend that only replicates the model (data parallel)."""

    parallelism = frozenset({"dp"})


class GroupAdvantage:
    """A group-normalised advantage (needs at least two samples per prompt)."""

    group_based = True

    class Config(_Options):
        pass

    def __init__(self, config, context) -> None:
        self.config, self.context = config, context

    def compute(self, rewards, group_ids):
        raise NotImplementedError


class ScalarAdvantage(GroupAdvantage):
    """An advantage that looks at one sample at a time."""

    group_based = False


class TestLoss:
    class Config(_Options):
        pass

    def __init__(self, config, context) -> None:
        self.config, self.context = config, context

    def compute(self, batch, logprobs):
        raise NotImplementedError


class TestLM:
    """A built-in model: 4 layers, 8 heads (4 kv heads), no download."""

    class Config(_Options):
        pass

    def __init__(self, config: Config) -> None:
        self.config = config

    def architecture(self) -> dict:
        return {"name": "builtin:test-lm", "num_layers": 4, "hidden_size": 64,
                "num_attention_heads": 8, "num_kv_heads": 4, "head_dim": 8,
                "intermediate_size": 128, "vocab_size": 64, "tie_embeddings": True}

    def materialize(self, cache_dir):
        raise NotImplementedError


class FlakyCalculator:
    """The built-in calculator, except that trajectory sample 1 of every prompt raises in ``step`` and
    sample 2 hangs there (longer than any tool timeout a test sets): environment failures in a run."""

    class Config(_Options):
        hang_s: float = Field(30.0, gt=0.0)
        """How long the hanging step sleeps."""

    def __init__(self, config: Config) -> None:
        from relax_plugins.environments.calculator import CalculatorEnvironment

        self.config = config
        self.calculator = CalculatorEnvironment(CalculatorEnvironment.Config())

    def tools(self):
        return self.calculator.tools()

    def start(self, task):
        return {"sample": task.sample, "inner": self.calculator.start(task)}

    def step(self, state, turn):
        import time

        if state["sample"] == 1:
            raise ConnectionError("the calculator service went away")
        if state["sample"] == 2:
            time.sleep(self.config.hang_s)
        return self.calculator.step(state["inner"], turn)
