"""Step rows of metrics.jsonl become gauges (values) and histograms (durations)."""

from __future__ import annotations

from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from relax.spec.models import RunSpec
from relax.telemetry import StepMetricsExporter
from relax.telemetry.metrics import instrument_name, numeric_items


def collected(reader: InMemoryMetricReader) -> dict[str, object]:
    data = reader.get_metrics_data()
    return {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


def test_rows_become_gauges_and_duration_histograms():
    reader = InMemoryMetricReader()
    exporter = StepMetricsExporter.from_spec(RunSpec(name="m"), reader=reader, spec_hash="h")
    for step, (reward, step_s) in enumerate([(0.1, 1.5), (0.4, 0.5), (0.3, 1.0)], 1):
        exporter.export({"step": step, "reward/mean": reward, "staleness/max": 1, "time/step_s": step_s,
                         "time/work_frac": 1.2, "data/order": "9f2c", "train": {"loss": 2.0 / step}})
    metrics = collected(reader)

    assert set(metrics) == {"relax.step", "relax.reward.mean", "relax.staleness.max", "relax.time.step_s",
                            "relax.time.work_frac", "relax.train.loss"}
    assert metrics["relax.reward.mean"].data.data_points[0].value == 0.3  # a gauge keeps the latest step
    assert metrics["relax.train.loss"].data.data_points[0].value == 2.0 / 3
    assert metrics["relax.time.work_frac"].data.data_points[0].value == 1.2  # a ratio, not a duration
    histogram = metrics["relax.time.step_s"].data.data_points[0]
    assert (histogram.count, histogram.sum, histogram.min, histogram.max) == (3, 3.0, 0.5, 1.5)
    assert metrics["relax.time.step_s"].unit == "s"
    resource = reader.get_metrics_data().resource_metrics[0].resource.attributes
    assert resource["relax.run"] == "m" and resource["relax.spec_hash"] == "h"
    exporter.shutdown()


def test_names_and_flattening():
    assert instrument_name("time/step_s") == "relax.time.step_s"
    assert instrument_name("train/kl (approx)") == "relax.train.kl__approx_"
    assert numeric_items({"a": 1, "b": "x", "c": {"d": 2.5, "e": True}}) == [("a", 1.0), ("c/d", 2.5), ("c/e", 1.0)]
