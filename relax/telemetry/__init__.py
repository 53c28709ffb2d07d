"""OpenTelemetry tracing and metrics of a run: one trace per run, following each sample from the
rollout to the optimizer step.

Imported by the runtime only (never by ``relax.spec``, ``relax.config`` or ``relax.plan``).
``relax.telemetry.analysis`` reads the traces back for ``relax trace``.
"""

from relax.telemetry.conventions import (
    ADVANTAGE_COMPUTE,
    AGENT_SEGMENT,
    AGENT_TOOL_CALL,
    AGENT_TURN,
    CHECKPOINT,
    EVALUATE,
    FAULT,
    FORWARD,
    REWARD_SCORE,
    ROLLOUT_BATCH,
    RUN,
    SCALE,
    STEP,
    TRAIN_STEP,
    WEIGHT_SYNC,
)
from relax.telemetry.jsonl import TRACES_FILE, JsonlSpanExporter, read_spans
from relax.telemetry.metrics import StepMetricsExporter
from relax.telemetry.propagation import extract, inject, link_from, links_from, step_span_id
from relax.telemetry.tracing import NULL_SPAN, OtlpUnavailable, RoleSpan, Telemetry

__all__ = [
    "ADVANTAGE_COMPUTE",
    "AGENT_SEGMENT",
    "AGENT_TOOL_CALL",
    "AGENT_TURN",
    "CHECKPOINT",
    "EVALUATE",
    "FAULT",
    "FORWARD",
    "NULL_SPAN",
    "REWARD_SCORE",
    "ROLLOUT_BATCH",
    "RUN",
    "SCALE",
    "STEP",
    "TRACES_FILE",
    "TRAIN_STEP",
    "WEIGHT_SYNC",
    "JsonlSpanExporter",
    "OtlpUnavailable",
    "RoleSpan",
    "StepMetricsExporter",
    "Telemetry",
    "extract",
    "inject",
    "link_from",
    "links_from",
    "read_spans",
    "step_span_id",
]
