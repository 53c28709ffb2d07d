"""Trace context across processes: W3C ``traceparent`` carriers, links, and per-step parents.

Carriers are plain ``dict[str, str]`` (what ``RowMeta.trace`` holds and what Ray pickles for
free). The propagator is always W3C Trace Context, whatever ``OTEL_PROPAGATORS`` says, so every
Relax process reads what every other one writes.

**Per-step parents without communication.** Roles work on different steps at the same time
(the rollout may be two steps ahead of the actor), and no process creates a step span that the
others could wait for. Instead the span id of step ``t``'s ``relax.step`` span is a pure
function of the run's trace id and ``t`` (``step_span_id``). Every process that knows the run's
carrier can parent its work for step ``t`` to that id at once, and the controller later emits the
one real ``relax.step`` span with exactly that id, covering the step's wall time
(``Telemetry.record_step``). Sampling follows the run's root: the step context carries the
root's trace flags, so a trace the driver did not sample costs nothing anywhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from relax.telemetry.conventions import ATTR_SAMPLES

_PROPAGATOR = TraceContextTextMapPropagator()

Carrier = Mapping[str, str]


def inject(context: context_api.Context | None = None) -> dict[str, str]:
    """The carrier of ``context``'s span (default: the current span); ``{}`` when there is none."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return carrier


def carrier_of(span_context: trace.SpanContext) -> dict[str, str]:
    """The carrier of one span context; ``{}`` when it is invalid."""
    if not span_context.is_valid:
        return {}
    return inject(trace.set_span_in_context(trace.NonRecordingSpan(span_context)))


def extract(carrier: Carrier | None) -> context_api.Context:
    """The context a carrier describes (an empty context when it describes none)."""
    return _PROPAGATOR.extract(dict(carrier or {}))


def span_context_of(carrier: Carrier | None) -> trace.SpanContext | None:
    """The remote span context in a carrier, or ``None`` when it holds no valid one."""
    if not carrier:
        return None
    span_context = trace.get_current_span(extract(carrier)).get_span_context()
    return span_context if span_context.is_valid else None


def link_from(carrier: Carrier | None, attributes: Mapping[str, Any] | None = None) -> trace.Link | None:
    """A link to the span a carrier describes, or ``None`` when it describes none."""
    span_context = span_context_of(carrier)
    return None if span_context is None else trace.Link(span_context, dict(attributes or {}))


def links_from(sources: Iterable[Any]) -> list[trace.Link]:
    """One link per distinct span among many carriers, e.g. the rows of a batch.

    ``sources`` holds carriers, objects with a ``trace`` carrier attribute (``RowMeta``) or dicts
    with a ``trace`` key (``RowMeta.to_tag()``). Each link says how many of the sources pointed at
    its span (``relax.samples``); links come in the order their spans first appear. Sources
    without a valid context are skipped.
    """
    counts: dict[tuple[str | None, str | None], int] = {}
    carriers: dict[tuple[str | None, str | None], Carrier] = {}
    last: Carrier | None = None
    key: tuple[str | None, str | None] = (None, None)
    for source in sources:  # every row of a step: the rows of one batch usually share one carrier
        if isinstance(source, dict):
            carrier = source.get("trace", source)
        else:
            carrier = getattr(source, "trace", None)
            if carrier is None and isinstance(source, Mapping):
                carrier = source["trace"] if "trace" in source else source
        if not carrier:
            continue
        if carrier is not last:
            key, last = (carrier.get("traceparent"), carrier.get("tracestate")), carrier
            if key not in counts:
                counts[key], carriers[key] = 0, carrier
        counts[key] += 1
    links = []
    for key, carrier in carriers.items():
        link = link_from(carrier, {ATTR_SAMPLES: counts[key]})
        if link is not None:
            links.append(link)
    return links


def step_span_id(trace_id: int, step: int) -> int:
    """The span id of step ``step``'s ``relax.step`` span in trace ``trace_id`` (never 0)."""
    digest = hashlib.blake2b(trace_id.to_bytes(16, "big") + step.to_bytes(8, "big", signed=True),
                             digest_size=8, person=b"relax.step").digest()
    return int.from_bytes(digest, "big") or 1


def step_span_context(run: trace.SpanContext, step: int) -> trace.SpanContext:
    """The (remote) span context of step ``step``'s span in the run whose root is ``run``."""
    return trace.SpanContext(run.trace_id, step_span_id(run.trace_id, step), is_remote=True,
                             trace_flags=run.trace_flags, trace_state=run.trace_state)


def step_context(run: trace.SpanContext, step: int) -> context_api.Context:
    """A context whose current span is step ``step``'s span: the parent of that step's work."""
    return trace.set_span_in_context(trace.NonRecordingSpan(step_span_context(run, step)))

