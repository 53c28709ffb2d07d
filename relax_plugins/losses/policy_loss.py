"""What every built-in policy loss shares: reading its ``AlgorithmContext``, the proximal policy, and the KL and
entropy terms around the surrogate.

A policy loss plugin computes ``(loss, metrics)`` from a ``relax.algo.batch.TrainBatch`` and the
trained policy's token log-probs ``[B, T]``::

    loss = surrogate(logprobs, old, advantages)                  # aggregated per the spec
         + kl_coef * aggregate(k(logprobs, ref_logprobs))        # when algorithm.kl_in is loss
         - entropy_coef * aggregate(entropy)                     # when algorithm.entropy_coef > 0

all three aggregated by ``algorithm.loss_aggregation`` (exposed as ``aggregation``, which trainers
read to weight micro-batches: by response tokens for ``token-mean``, by rows otherwise).

The proximal ("old") policy of the ratio and the per-token correction weight follow
``async_policy.correction`` (the formulas: ``relax.algo.corrections``, docs/off-policy.md):

* ``none``: the ratio against ``batch.old_logprobs`` if recomputed, else the behaviour log-probs;
  no weight.
* ``tis``: the same ratio, times ``min(exp(old - behaviour), tis_cap)`` (1 without a recompute).
* ``decoupled``: the ratio against the proximal log-probs that ``roles.actor_fwd`` recomputed
  (``batch.old_logprobs``, required), times the truncated behaviour weight
  ``min(exp(old - behaviour), tis_cap)``: the clip trusts the proximal policy and the weight
  corrects for the stale behaviour policy that drew the samples (Hilton et al. 2021).
* ``seq_tis``, ``token_mis``, ``seq_mis``, ``geo_reject``, ``icepop``: like ``decoupled`` (the
  proximal log-probs are required), with that correction's weight of proximal / behaviour; the
  tokens and sequences a correction drops weigh 0.
* ``opsm``: the ratio as for ``none``; negative-advantage sequences whose behaviour policy is more
  than ``opsm_delta`` away from the policy being trained weigh 0.

Loss metrics add ``correction_kept_frac``, the share of response tokens the correction left a
nonzero weight (1 for the corrections that only reweight). The KL and entropy terms are not
weighted: they regularise the policy on every token.

torch is imported inside methods so ``relax validate`` can import the module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from relax.contracts import CORRECTIONS, PROXIMAL_CORRECTIONS, AlgorithmContext


class PolicyLoss(ABC):
    """Base of the built-in policy losses; a subclass implements ``surrogate``."""

    #: Most ``async_policy.max_staleness`` the loss is sound for; None: any (it has an importance
    #: ratio against the behaviour or proximal policy). ``relax validate`` rejects a larger bound.
    tolerated_staleness: ClassVar[int | None] = None
    #: The ``async_policy.correction`` values the loss honours: every one of the menu, since the
    #: weight multiplies the per-token loss whatever it is.
    corrections: ClassVar[frozenset[str]] = CORRECTIONS
    #: Whether ``compute`` must be given per-token entropy; the instance sets it from its context
    #: (``algorithm.entropy_coef > 0``).
    needs_entropy: bool = False

    class Config(BaseModel):
        """This loss takes its settings from the ``algorithm`` and ``async_policy`` sections."""

        model_config = ConfigDict(extra="forbid")

    def __init__(self, config: BaseModel, context: AlgorithmContext) -> None:
        self.config = config
        self.aggregation: str = context.loss_aggregation or "token-mean"
        """How per-token losses are reduced (``relax.algo.losses.aggregate``)."""
        self.norm_tokens = int(context.max_new_tokens)
        """The constant denominator of ``seq-mean-token-sum-norm``: the generation budget."""
        self.kl_coef = float(context.kl_coef) if context.kl_in == "loss" else 0.0
        self.kl_estimator = context.kl_estimator or "k3"
        self.entropy_coef = float(context.entropy_coef)
        self.needs_entropy = self.entropy_coef > 0
        self.correction = context.correction
        self.tis_cap = float(context.tis_cap) if self.correction in ("tis", "decoupled") else None
        self.bounds = context
        """The bounds of every correction (the context has them: ``relax.algo.corrections.CorrectionBounds``)."""
        if self.correction not in self.corrections:
            raise ValueError(f"loss {type(self).__name__} does not honour async_policy.correction "
                             f"'{self.correction}' (it honours {', '.join(sorted(self.corrections))})")

    def proximal(self, batch: Any) -> Any:
        """The log-probs the ratio is taken against (see the module docstring)."""
        if self.correction in PROXIMAL_CORRECTIONS:
            if batch.old_logprobs is None:
                raise ValueError(f"async_policy.correction is {self.correction} but the batch has no old_logprobs; "
                                 "the proximal log-probs of roles.actor_fwd must be attached to the batch")
            return batch.old_logprobs
        return batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs

    def weight(self, batch: Any, logprobs: Any, old: Any) -> Any:
        """The correction's detached per-token weight ``[B, T]`` (None for ``none``)."""
        from relax.algo.corrections import correction_weight

        return correction_weight(self.correction, logprobs=logprobs, proximal=old, behaviour=batch.rollout_logprobs,
                                 advantages=batch.advantages, mask=batch.response_mask, bounds=self.bounds)

    @abstractmethod
    def surrogate(self, batch: Any, logprobs: Any, old: Any, weight: Any) -> tuple[Any, dict[str, float]]:
        """The aggregated policy loss and its metrics, the ratio taken against ``old`` and each
        token's term multiplied by ``weight`` (the correction's; None: 1)."""

    def compute(self, batch: Any, logprobs: Any, *, entropy: Any = None) -> tuple[Any, dict[str, float]]:
        """``(loss, metrics)`` for token log-probs ``logprobs[B, T]`` of the policy being trained;
        ``entropy`` is the policy's per-token entropy ``[B, T]`` (aligned like log-probs), needed
        when ``needs_entropy``."""
        from relax.algo.kl import kl_divergence
        from relax.algo.losses import aggregate, masked_mean

        old = self.proximal(batch)
        weight = self.weight(batch, logprobs, old)
        loss, metrics = self.surrogate(batch, logprobs, old, weight)
        mask = batch.response_mask
        if weight is not None:
            metrics["correction_kept_frac"] = masked_mean((weight > 0).to(logprobs.dtype), mask).item()
        if self.kl_coef > 0:
            if batch.ref_logprobs is None:
                raise ValueError(f"algorithm.kl_coef is {self.kl_coef} with kl_in loss, but the batch has no "
                                 "ref_logprobs; roles.reference must attach them")
            kl = kl_divergence(logprobs, batch.ref_logprobs, self.kl_estimator, mask)
            loss = loss + self.kl_coef * aggregate(kl, mask, self.aggregation, self.norm_tokens)
            metrics["kl"] = masked_mean(kl.detach(), mask).item()
        if self.entropy_coef > 0:
            if entropy is None:
                raise ValueError(f"algorithm.entropy_coef is {self.entropy_coef} but no entropy was given; "
                                 "the trainer must pass entropy=[B, T] when loss.needs_entropy is true")
            loss = loss - self.entropy_coef * aggregate(entropy, mask, self.aggregation, self.norm_tokens)
            metrics["entropy"] = masked_mean(entropy.detach(), mask).item()
        return loss, metrics

