"""``genrm``: a generative reward model: an LLM judge reads each response and gives a verdict.

The judge model is served by a ``relax.rollout`` backend (``hf`` by default), built in the reward
worker through the ``RewardContext`` the runtime hands the reward (its factory materializes the
judge model and builds the backend through the registry) with a ``RolloutContext`` of its own
(role ``reward``), so any backend a run can generate with can also judge. Nothing here imports the
runtime or reads the run spec. Each sample becomes a judge prompt by filling
``template`` (fields ``{prompt}``, ``{response}``, ``{label}``); the judge's reply is parsed by
``verdict_pattern`` and mapped to a score by ``verdict_scores``.

A judge holds a model, so validation requires ``roles.reward.host: own`` for it: it must not share
the rollout worker's process (``model_based`` below tells the rule).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from relax.contracts import ModelInfo, RewardContext, RewardSample, RolloutContext, SamplingInfo

DEFAULT_TEMPLATE = (
    "You are grading an answer.\n\nQuestion:\n{prompt}\n\nReference answer:\n{label}\n\n"
    "Candidate answer:\n{response}\n\nIs the candidate answer correct? Reply yes or no.\n"
)
TEMPLATE_FIELDS = frozenset({"prompt", "response", "label"})


class JudgeSampling(BaseModel):
    """How the judge samples its verdict (greedy by default: a verdict should be reproducible)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.0, ge=0.0)
    """Softmax temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Keep the k most likely tokens; 0 keeps all."""
    max_new_tokens: int = Field(16, ge=1)
    """Longest verdict in tokens."""


class VerdictParser:
    """Turns a judge's reply into a score: the first group of the first ``pattern`` match, mapped
    through ``scores`` (case-folded), or read as a number when ``scores`` is empty."""

    def __init__(self, pattern: str, scores: dict[str, float], unparsed: float) -> None:
        self.pattern = re.compile(pattern)
        self.scores = {k.casefold(): v for k, v in scores.items()}
        self.unparsed = unparsed

    def __call__(self, reply: str) -> float:
        found = self.pattern.search(reply)
        if found is None or found.group(1) is None:
            return self.unparsed
        verdict = found.group(1).strip()
        if not self.scores:
            try:
                return float(verdict)
            except ValueError:
                return self.unparsed
        return self.scores.get(verdict.casefold(), self.unparsed)


class GenerativeJudge:
    """Scores each response with a judge model's verdict (the mean over ``votes`` verdicts)."""

    model_based: ClassVar[bool] = True
    """Holds a model: validation requires ``roles.reward.host: own``."""

    class Config(BaseModel):
        """Options of the generative (LLM-judge) reward."""

        model_config = ConfigDict(extra="forbid")

        model: str = "builtin:tiny-lm"
        """The judge: a local Hugging Face folder (absolute, or relative to the working directory)
        or ``builtin:<name>`` built by a ``relax.models`` plugin."""
        model_options: dict[str, Any] = Field(default_factory=dict)
        """Options of a built-in judge model (e.g. ``{task: judge}`` for ``builtin:tiny-lm``)."""
        dtype: Literal["float32", "bfloat16", "float16"] = "float32"
        """Parameter dtype of the judge: float32, bfloat16 or float16."""
        backend: str = "hf"
        """The ``relax.rollout`` plugin that serves the judge."""
        backend_options: dict[str, Any] = Field(default_factory=dict)
        """Options of that backend, checked against its ``Config``."""
        template: str = DEFAULT_TEMPLATE
        """The judge's prompt; ``{prompt}``, ``{response}`` and ``{label}`` are filled per sample
        (write ``{{`` and ``}}`` for literal braces)."""
        response_stop: list[str] = Field(default_factory=lambda: ["<|endoftext|>", "<|im_end|>", "</s>", "<eos>"])
        """The response is cut at the first of these strings before it is shown to the judge."""
        chat_template: bool = False
        """Wrap the filled template in the judge tokenizer's chat template as one user turn."""
        sampling: JudgeSampling = Field(default_factory=JudgeSampling)
        """How the judge samples."""
        votes: int = Field(1, ge=1)
        """Verdicts per response; the score is their mean (use with temperature > 0)."""
        verdict_pattern: str = r"(?i)\b(yes|no)\b"
        """Regular expression finding the verdict in the judge's reply; its first group is the
        verdict (the first match counts)."""
        verdict_scores: dict[str, float] = Field(default_factory=lambda: {"yes": 1.0, "no": 0.0})
        """Score of each verdict (compared case-folded). Empty: the verdict is a number, used as the
        score (e.g. a pattern ``Score: (\\d+)``)."""
        unparsed_score: float = 0.0
        """Score of a reply without a verdict."""
        max_prompt_tokens: int = Field(2048, ge=1)
        """Longest judge prompt in tokens (cut from the left)."""
        seed: int = Field(0, ge=0)
        """Seed of the judge's sampling."""

        @field_validator("template")
        @classmethod
        def _fields(cls, value: str) -> str:
            import string

            try:
                names = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
            except ValueError as exc:
                raise ValueError(f"is not a valid template ({exc}); write literal braces as {{{{ and }}}}") from None
            unknown = names - TEMPLATE_FIELDS
            if unknown:
                raise ValueError(f"uses unknown field(s) {sorted(unknown)}; use {{prompt}}, {{response}} and {{label}}")
            if "response" not in names:
                raise ValueError("never shows the judge the response; include {response}")
            return value

        @field_validator("verdict_pattern")
        @classmethod
        def _pattern(cls, value: str) -> str:
            try:
                groups = re.compile(value).groups
            except re.error as exc:
                raise ValueError(f"is not a valid regular expression ({exc})") from None
            if groups < 1:
                raise ValueError("needs a capturing group around the verdict, e.g. (yes|no)")
            return value

    def __init__(self, config: GenerativeJudge.Config, *, context: RewardContext | None = None) -> None:
        if context is None:
            raise ValueError("genrm serves a judge model and must be built with a RewardContext (the runtime "
                             "passes one: relax.runtime.worker.components.build_reward); pass "
                             "context=RewardContext(...)")
        self.config = config
        self.verdict = VerdictParser(config.verdict_pattern, config.verdict_scores, config.unparsed_score)
        path = context.materialize_model(config.model, dict(config.model_options))
        if not Path(path).is_dir():
            raise FileNotFoundError(f"genrm: the judge model {config.model!r} is not a folder (looked at {path}); "
                                    "give a local Hugging Face folder or builtin:<name>")
        self.model_path = path
        self.sampling = SamplingInfo.model_validate(config.sampling.model_dump())
        """How the judge samples (passed to every ``generate``)."""
        # The judge's own rollout context: its model, dtype, prompt length and sampling, nothing of
        # the policy's run; on the reward worker's GPU when the plan gave it one.
        rollout = RolloutContext(role="reward", model=ModelInfo(path=path, dtype=config.dtype),
                                 sampling=self.sampling, max_prompt_tokens=config.max_prompt_tokens,
                                 device=context.device, seed=config.seed)
        self.backend = context.build_rollout(config.backend, dict(config.backend_options), rollout)
        self._tokenizer: Any = None
        self._lock = threading.Lock()  # one generate at a time: backends are not re-entrant
        self._calls = 0

    def judge_prompt(self, sample: RewardSample) -> str:
        """The judge's input for one sample."""
        response = sample.response
        for stop in self.config.response_stop:
            if stop and stop in response:
                response = response[:response.index(stop)]
        label = "" if sample.label is None else sample.label
        text = self.config.template.format(prompt=sample.prompt, response=response, label=label)
        if not self.config.chat_template:
            return text
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)

    def score(self, samples: list[RewardSample]) -> list[float]:
        if not samples:
            return []
        votes = self.config.votes
        prompts = [self.judge_prompt(s) for s in samples]
        with self._lock:
            self._calls += 1
            gens = self.backend.generate(prompts, votes, self.sampling,
                                         self.config.seed + self._calls)
        totals = [0.0] * len(samples)
        for gen in gens:
            totals[gen.prompt_index] += self.verdict(gen.text)
        return [total / votes for total in totals]
