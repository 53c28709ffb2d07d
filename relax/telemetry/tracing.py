"""Per-process tracing: one ``Telemetry`` per Relax process (the driver and each role worker).

Each process builds its own ``TracerProvider`` from the spec and never touches OpenTelemetry's
global provider, so it works the same in the driver, in a Ray worker and in a test that runs
several "processes" as threads. With ``tracing.exporter: none`` no provider is built at all and
every call returns at once (a shared no-op span, an empty carrier).

Driver::

    telemetry = Telemetry.from_spec(spec, output_dir, role="controller", spec_hash=h)
    with telemetry.run_span(steps=spec.trainer.steps) as run:
        carrier = run.carrier()          # hand to every worker
        ...
        telemetry.record_step(step, started_at, ended_at)   # per finished step
    telemetry.shutdown()

Worker::

    telemetry = Telemetry.from_spec(spec, output_dir, role="rollout", spec_hash=h, run_carrier=carrier)
    with telemetry.span(ROLLOUT_BATCH, step=t, policy_version=v) as span:
        ...
        span.set(samples=n, tokens=k)
    telemetry.shutdown()
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Status, StatusCode

import relax
from relax.telemetry.conventions import (
    ATTR_ROLE,
    ATTR_STEP,
    RES_RUN,
    RES_SPEC_HASH,
    RES_VERSION,
    ROLE_OF_SPAN,
    RUN,
    STEP,
    relax_attributes,
)
from relax.telemetry.jsonl import TRACES_FILE, JsonlSpanExporter, span_to_dict
from relax.telemetry.propagation import (
    Carrier,
    carrier_of,
    links_from,
    span_context_of,
    step_context,
    step_span_id,
)

if TYPE_CHECKING:
    from relax.spec.models import RunSpec, TracingSpec

#: How often the batch processor ships spans (ms); the default 5 s loses more on a hard kill.
BATCH_DELAY_MS = 1000
#: Step parent contexts kept ready (roles work on a few steps at a time).
STEP_CONTEXT_CACHE = 64
INSTRUMENTATION = "relax"


class OtlpUnavailable(RuntimeError):
    """``tracing.exporter: otlp`` without the OTLP exporter package installed."""


class RoleSpan:
    """A span being recorded, as Relax code handles it; ``otel`` is the OpenTelemetry span."""

    __slots__ = ("otel",)

    def __init__(self, otel: trace.Span) -> None:
        self.otel = otel

    @property
    def recording(self) -> bool:
        return self.otel.is_recording()

    def set(self, **attributes: Any) -> None:
        """Set attributes; ``samples=8`` is recorded as ``relax.samples`` (None values are skipped)."""
        self.otel.set_attributes(relax_attributes(attributes))

    def carrier(self) -> dict[str, str]:
        """This span's W3C carrier, e.g. for ``RowMeta.trace`` of the rows it produced."""
        return carrier_of(self.otel.get_span_context())

    def link(self, sources: Iterable[Any]) -> None:
        """Add links to the distinct spans of ``sources`` (carriers or rows with ``.trace``)."""
        for link in links_from(sources):
            self.otel.add_link(link.context, link.attributes)


class _NullSpan(RoleSpan):
    """What a disabled ``Telemetry`` hands out: every method does nothing."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(trace.INVALID_SPAN)

    def set(self, **attributes: Any) -> None:
        pass

    def carrier(self) -> dict[str, str]:
        return {}

    def link(self, sources: Iterable[Any]) -> None:
        pass

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


NULL_SPAN = _NullSpan()


class _SpanScope:
    """``with`` block of one span: current while the block runs, an error if it raises.

    What ``Tracer.start_as_current_span`` does, without its two generator-based layers.
    """

    __slots__ = ("_tracer", "_name", "_parent", "_attributes", "_links", "_span", "_token")

    def __init__(self, tracer: trace.Tracer, name: str, parent: context_api.Context | None,
                 attributes: dict[str, Any], links: list[trace.Link]) -> None:
        self._tracer, self._name, self._parent = tracer, name, parent
        self._attributes, self._links = attributes, links

    def __enter__(self) -> RoleSpan:
        span = self._span = self._tracer.start_span(self._name, context=self._parent, attributes=self._attributes,
                                                    links=self._links)
        self._token = context_api.attach(trace.set_span_in_context(span))
        return RoleSpan(span)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        span = self._span
        try:
            if exc is not None and span.is_recording():
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        finally:
            context_api.detach(self._token)
            span.end()


class _StepIdGenerator(RandomIdGenerator):
    """Random ids, except the one span id a thread asked for next (``relax.step`` spans)."""

    def __init__(self) -> None:
        self._forced = threading.local()

    def force_next_span_id(self, span_id: int | None) -> None:
        self._forced.span_id = span_id

    def generate_span_id(self) -> int:
        forced = getattr(self._forced, "span_id", None)
        if forced is not None:
            self._forced.span_id = None
            return forced
        return super().generate_span_id()


class Telemetry:
    """Tracing for one process of a run. Build it with ``from_spec`` (or ``disabled``)."""

    def __init__(self, role: str, exporter: SpanExporter | None, *, resource: Resource | None = None,
                 sampling_ratio: float = 1.0, batch: bool = True, run_carrier: Carrier | None = None) -> None:
        """``exporter=None`` disables tracing; ``batch=False`` exports each span as it ends (tests)."""
        self.role = role
        self.enabled = exporter is not None
        self.provider: TracerProvider | None = None
        self._run_span: trace.Span | None = None
        self._run: trace.SpanContext | None = None
        self._step_contexts: dict[int, context_api.Context] = {}
        if exporter is None:
            return
        self._ids = _StepIdGenerator()
        self.provider = TracerProvider(resource=resource or Resource.create({ATTR_ROLE: role}),
                                       sampler=ParentBased(TraceIdRatioBased(sampling_ratio)),
                                       id_generator=self._ids, shutdown_on_exit=False)
        processor = BatchSpanProcessor(exporter, schedule_delay_millis=BATCH_DELAY_MS) if batch \
            else SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer(INSTRUMENTATION, relax.__version__)
        # Flush at interpreter exit if nobody called shutdown (Ray's graceful exit runs atexit).
        self._finalizer = weakref.finalize(self, self.provider.shutdown)
        if run_carrier:
            self.join_run(run_carrier)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_spec(cls, spec: RunSpec, output_dir: str | Path, role: str, *, spec_hash: str = "",
                  run_carrier: Carrier | None = None, exporter: SpanExporter | None = None) -> Telemetry:
        """Tracing as ``spec.tracing`` asks, for the process hosting ``role``.

        ``exporter`` replaces the spec's exporter (tests pass an ``InMemorySpanExporter``; spans
        are then exported synchronously). ``run_carrier`` is the driver's ``relax.run`` carrier.
        """
        tracing = spec.tracing
        if exporter is None:
            if tracing.exporter == "none":
                return cls.disabled(role)
            exporter = span_exporter(tracing, Path(output_dir))
            batch = True
        else:
            batch = False
        return cls(role, exporter, resource=run_resource(spec, role, spec_hash),
                   sampling_ratio=tracing.sampling_ratio, batch=batch, run_carrier=run_carrier)

    @classmethod
    def disabled(cls, role: str = "") -> Telemetry:
        """A Telemetry that records nothing and costs nothing."""
        return cls(role, None)

    # -- the run -----------------------------------------------------------------------------

    @contextmanager
    def run_span(self, **attributes: Any) -> Iterator[RoleSpan]:
        """The root ``relax.run`` span (driver only); its ``carrier()`` goes to every worker."""
        if not self.enabled:
            yield NULL_SPAN
            return
        with self.tracer.start_as_current_span(RUN, context=context_api.Context(),
                                               attributes=relax_attributes(attributes)) as span:
            self._run_span, self._run = span, span.get_span_context()
            self._step_contexts.clear()
            try:
                yield RoleSpan(span)
            finally:
                self._run_span = None

    def join_run(self, run_carrier: Carrier) -> None:
        """Make this process's spans part of the run whose root ``run_carrier`` describes."""
        self._run = span_context_of(run_carrier)
        self._step_contexts.clear()

    @property
    def run_carrier(self) -> dict[str, str]:
        """The carrier of the run's root span ({} when disabled or not joined)."""
        return carrier_of(self._run) if self._run is not None else {}

    def step_context(self, step: int) -> context_api.Context | None:
        """The context whose span is step ``step``'s ``relax.step`` span, once a run is known."""
        return step_context(self._run, step) if self._run is not None else None

    # -- spans -------------------------------------------------------------------------------

    def span(self, name: str, *, step: int | None = None, role: str | None = None,
             links: Iterable[Any] = (), **attributes: Any) -> AbstractContextManager[RoleSpan]:
        """A context manager recording one unit of work; yields a ``RoleSpan``.

        Parent: the current span if it is a work span of this run (nesting), else step ``step``'s
        span, else the run's root. ``relax.role`` is ``role``, else the span's own role (see
        ``ROLE_OF_SPAN``), else this process's role. ``links`` holds ``Link`` objects, carriers or
        rows with a ``.trace`` carrier (one link per distinct span). Other keywords become
        ``relax.<key>`` attributes. An exception leaving the block marks the span as an error.
        """
        if not self.enabled:
            return NULL_SPAN
        return self._span(name, step, role, links, attributes)

    def _span(self, name: str, step: int | None, role: str | None, links: Iterable[Any],
              attributes: dict[str, Any]) -> _SpanScope:
        attrs = relax_attributes(attributes)
        attrs[ATTR_ROLE] = role or ROLE_OF_SPAN.get(name) or self.role
        if step is not None:
            attrs[ATTR_STEP] = step
        ready: list[trace.Link] = []
        if links:
            items = list(links)
            ready = [link for link in items if isinstance(link, trace.Link)]
            ready += links_from(item for item in items if not isinstance(item, trace.Link))
        return _SpanScope(self.tracer, name, self._parent(step), attrs, ready)

    def _parent(self, step: int | None) -> context_api.Context | None:
        run = self._run
        if run is None:
            return None  # the current context, whatever it is
        current = trace.get_current_span().get_span_context()
        if current.trace_id == run.trace_id and current.span_id != run.span_id and current.is_valid:
            return None  # nested in a work span of this run
        if step is None:
            return trace.set_span_in_context(self._run_span or trace.NonRecordingSpan(run))
        parent = self._step_contexts.get(step)
        if parent is None:
            if len(self._step_contexts) >= STEP_CONTEXT_CACHE:
                self._step_contexts.clear()
            parent = self._step_contexts[step] = step_context(run, step)
        return parent

    def record_step(self, step: int, start_s: float, end_s: float, **attributes: Any) -> None:
        """Emit step ``step``'s ``relax.step`` span, from ``start_s`` to ``end_s`` (``time.time()``).

        Its span id is the one every role already used as the parent of its work for that step.
        Call it once per step, in one process (the controller). Needs a run (``run_span`` or
        ``join_run``); without one it does nothing.
        """
        if not self.enabled or self._run is None:
            return
        parent = trace.set_span_in_context(self._run_span or trace.NonRecordingSpan(self._run))
        attrs = relax_attributes(attributes)
        attrs[ATTR_STEP] = step
        self._ids.force_next_span_id(step_span_id(self._run.trace_id, step))
        try:
            span = self.tracer.start_span(STEP, context=parent, attributes=attrs, start_time=int(start_s * 1e9))
        finally:
            self._ids.force_next_span_id(None)
        span.end(end_time=int(end_s * 1e9))

    # -- lifecycle ---------------------------------------------------------------------------

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Export every finished span now; False if that did not finish within ``timeout_s``."""
        if self.provider is None:
            return True
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flush and stop exporting (idempotent). Call it when the process's work is done."""
        if self.provider is not None:
            self._finalizer()  # runs provider.shutdown() once


# -- building blocks from the spec -------------------------------------------------------------


def run_resource(spec: RunSpec, role: str, spec_hash: str = "") -> Resource:
    """The resource of one process of the run: who emits the spans.

    ``tracing.resource_attributes`` are added first, so they cannot replace the built-in keys
    (set ``tracing.service_name`` for the service name).
    """
    attributes: dict[str, Any] = dict(spec.tracing.resource_attributes)
    attributes.update({
        "service.name": spec.tracing.service_name or spec.name,
        RES_RUN: spec.name,
        RES_SPEC_HASH: spec_hash,
        RES_VERSION: relax.__version__,
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
        ATTR_ROLE: role,
    })
    return Resource.create(attributes)


def traces_path(tracing: TracingSpec, output_dir: Path) -> Path:
    """The jsonl file: ``tracing.endpoint`` (relative to ``output_dir``) or ``<output_dir>/traces.jsonl``."""
    if tracing.endpoint:
        return output_dir / Path(tracing.endpoint).expanduser()  # an absolute endpoint wins over output_dir
    return output_dir / TRACES_FILE


def otlp_http_url(endpoint: str | None, signal: str) -> str | None:
    """``collector:4318`` or ``http://collector:4318`` -> ``http://collector:4318/v1/<signal>``.

    A URL already naming another signal's path (``/v1/traces``) is pointed at ``signal``; any
    other explicit path is kept. ``None`` leaves the choice to the SDK (``OTEL_EXPORTER_OTLP_*``).
    """
    if not endpoint:
        return None
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    url = urlparse(endpoint)
    path = url.path.rstrip("/")
    for known in ("/v1/traces", "/v1/metrics", "/v1/logs"):
        if path.endswith(known):
            path = path[: -len(known)]
            break
    else:
        if path:
            return endpoint
    return url._replace(path=f"{path}/v1/{signal}").geturl()


def span_exporter(tracing: TracingSpec, output_dir: Path) -> SpanExporter | None:
    """The exporter ``tracing.exporter`` names (``None`` for ``none``)."""
    if tracing.exporter == "none":
        return None
    if tracing.exporter == "console":
        return ConsoleSpanExporter(out=sys.stdout, formatter=_console_line)
    if tracing.exporter == "jsonl":
        return JsonlSpanExporter(traces_path(tracing, output_dir))
    return otlp_exporter(tracing, "traces")


_OTLP_CLASSES = {"traces": ("trace_exporter", "OTLPSpanExporter"), "metrics": ("metric_exporter", "OTLPMetricExporter")}


def otlp_exporter(tracing: TracingSpec, signal: str) -> Any:
    """The OTLP exporter of ``signal`` (traces or metrics) over ``tracing.protocol``, imported only now
    because the OTLP packages are an optional extra."""
    module, name = _OTLP_CLASSES[signal]
    try:
        exporters = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{tracing.protocol}.{module}")
    except ImportError as exc:
        raise OtlpUnavailable(f"tracing.exporter otlp needs the OTLP exporter ({exc.name} is missing): "
                              "pip install 'relax-rl[otlp]', or set tracing.exporter to jsonl") from None
    endpoint = tracing.endpoint if tracing.protocol == "grpc" else otlp_http_url(tracing.endpoint, signal)
    return getattr(exporters, name)(endpoint=endpoint)


def _console_line(span: ReadableSpan) -> str:
    return json.dumps(span_to_dict(span), separators=(",", ":"), default=str) + "\n"
