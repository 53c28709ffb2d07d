"""The per-step figures of metrics.jsonl as OpenTelemetry metrics (``tracing.exporter: otlp`` only).

Each numeric key of a step row becomes one instrument named ``relax.<key>`` with ``/`` turned
into ``.`` (``time/step_s`` -> ``relax.time.step_s``). Keys ending in ``_s`` are durations and
go to histograms (unit ``s``, buckets from 10 ms to 30 min), so a backend can show their
distribution over steps; every other number (reward, staleness, loss, tokens/s, the step) is a
gauge holding the latest step's value. Strings (``data/order``) are skipped; nested dicts are
flattened with ``/``. No per-point attributes: the resource (run, spec hash, role) says whose
figures they are, and a step attribute would create one series per step.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

import relax
from relax.telemetry.tracing import otlp_exporter, run_resource

if TYPE_CHECKING:
    from relax.spec.models import RunSpec, TracingSpec

#: Histogram buckets for durations (seconds).
DURATION_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0,
                      1000.0, 1800.0)
#: How often the OTLP reader pushes (ms); ``flush`` pushes at once.
EXPORT_INTERVAL_MS = 10_000
_BAD_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")


def instrument_name(key: str) -> str:
    """``time/step_s`` -> ``relax.time.step_s`` (characters OpenTelemetry refuses become ``_``)."""
    return "relax." + _BAD_CHARS.sub("_", key.replace("/", "."))


def numeric_items(row: Mapping[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    """The (key, value) pairs of a step row that are numbers, nested dicts flattened with ``/``."""
    items: list[tuple[str, float]] = []
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            items += numeric_items(value, f"{name}/")
        elif isinstance(value, (int, float)):  # bool included, as 0/1
            items.append((name, float(value)))
    return items


class StepMetricsExporter:
    """Exports one metrics.jsonl row per step as OpenTelemetry metrics; a no-op unless enabled."""

    def __init__(self, reader: MetricReader | None, *, resource: Resource | None = None) -> None:
        """``reader=None`` disables it; tests pass an ``InMemoryMetricReader``."""
        self.enabled = reader is not None
        self.provider: MeterProvider | None = None
        self._instruments: dict[str, Any] = {}
        if reader is None:
            return
        self.provider = MeterProvider(metric_readers=[reader], resource=resource or Resource.create({}),
                                      shutdown_on_exit=False)
        self.meter = self.provider.get_meter("relax", relax.__version__)
        # Push at interpreter exit if nobody called shutdown; runs at most once.
        self._finalizer = weakref.finalize(self, self.provider.shutdown)

    @classmethod
    def from_spec(cls, spec: RunSpec, *, role: str = "controller", spec_hash: str = "",
                  reader: MetricReader | None = None) -> StepMetricsExporter:
        """Enabled when ``tracing.exporter`` is otlp (to the same collector), or when given a reader."""
        if reader is None:
            if spec.tracing.exporter != "otlp":
                return cls(None)
            reader = PeriodicExportingMetricReader(metric_exporter(spec.tracing),
                                                   export_interval_millis=EXPORT_INTERVAL_MS)
        return cls(reader, resource=run_resource(spec, role, spec_hash))

    def export(self, row: Mapping[str, Any]) -> None:
        """Record one step's row (as ``step_row`` builds it)."""
        if not self.enabled:
            return
        for key, value in numeric_items(row):
            instrument = self._instrument(key)
            if key.endswith("_s"):
                instrument.record(value)
            else:
                instrument.set(value)

    def _instrument(self, key: str) -> Any:
        instrument = self._instruments.get(key)
        if instrument is None:
            name = instrument_name(key)
            if key.endswith("_s"):
                instrument = self.meter.create_histogram(name, unit="s", description=f"{key} per step",
                                                         explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S)
            else:
                instrument = self.meter.create_gauge(name, description=f"{key} of the latest step")
            self._instruments[key] = instrument
        return instrument

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Push what was recorded now."""
        return True if not self.enabled else self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Push and stop (idempotent)."""
        if self.provider is not None:
            self._finalizer()
            self.enabled = False


def metric_exporter(tracing: TracingSpec) -> Any:
    """The OTLP metric exporter for ``tracing`` (same endpoint and protocol as the spans)."""
    return otlp_exporter(tracing, "metrics")
