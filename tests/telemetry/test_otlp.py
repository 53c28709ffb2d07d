"""``tracing.exporter: otlp`` against tiny loopback collectors (HTTP and gRPC): spans and step metrics
arrive as OTLP protobuf."""

from __future__ import annotations

import gzip
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs the otlp extra (pip install -e '.[test]')")
import grpc  # noqa: E402  (comes with Ray and the OTLP gRPC exporter)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (  # noqa: E402
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from relax.spec.models import RunSpec  # noqa: E402
from relax.telemetry import ROLLOUT_BATCH, TRAIN_STEP, StepMetricsExporter, Telemetry  # noqa: E402
from relax.telemetry.tracing import otlp_http_url  # noqa: E402


class Collector:
    """A stdlib HTTP server taking OTLP/HTTP protobuf posts on 127.0.0.1 (port 0)."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, str, bytes]] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                collector.posts.append((self.path, self.headers["Content-Type"], body))
                reply = (ExportTraceServiceResponse() if self.path == "/v1/traces"
                         else ExportMetricsServiceResponse()).SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Collector:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def bodies(self, path: str) -> list[bytes]:
        return [body for p, _, body in self.posts if p == path]


def otlp_spec(endpoint: str, protocol: str = "http") -> RunSpec:
    return RunSpec(name="otlp-run", tracing={"exporter": "otlp", "endpoint": endpoint, "protocol": protocol,
                                             "service_name": "relax-test"})


def span_names(request: ExportTraceServiceRequest) -> list[str]:
    return [span.name for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]


def resource_of(request: ExportTraceServiceRequest) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in request.resource_spans[0].resource.attributes}


def test_spans_reach_an_otlp_http_collector(tmp_path):
    with Collector() as collector:
        tel = Telemetry.from_spec(otlp_spec(collector.url), tmp_path, "controller", spec_hash="s1")
        with tel.run_span():
            with tel.span(ROLLOUT_BATCH, step=0, samples=4):
                pass
            with tel.span(TRAIN_STEP, step=0):
                pass
        tel.shutdown()

    assert {(path, kind) for path, kind, _ in collector.posts} == {("/v1/traces", "application/x-protobuf")}
    requests = [ExportTraceServiceRequest.FromString(body) for body in collector.bodies("/v1/traces")]
    assert sorted(n for r in requests for n in span_names(r)) == sorted([ROLLOUT_BATCH, TRAIN_STEP, "relax.run"])
    resource = resource_of(requests[0])
    assert resource["service.name"] == "relax-test"
    assert resource["relax.run"] == "otlp-run" and resource["relax.spec_hash"] == "s1"


def test_step_metrics_reach_an_otlp_http_collector():
    with Collector() as collector:
        metrics = StepMetricsExporter.from_spec(otlp_spec(collector.url), spec_hash="s1")
        assert metrics.enabled
        metrics.export({"step": 1, "reward/mean": 0.25, "time/step_s": 2.0, "data/order": "abc"})
        metrics.export({"step": 2, "reward/mean": 0.75, "time/step_s": 4.0, "data/order": "def"})
        metrics.shutdown()

    bodies = collector.bodies("/v1/metrics")
    assert bodies
    found = {}
    for body in bodies:
        for rm in ExportMetricsServiceRequest.FromString(body).resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    found[metric.name] = metric
    assert set(found) == {"relax.step", "relax.reward.mean", "relax.time.step_s"}
    assert found["relax.reward.mean"].gauge.data_points[0].as_double == 0.75
    histogram = found["relax.time.step_s"].histogram.data_points[0]
    assert (histogram.count, histogram.sum, found["relax.time.step_s"].unit) == (2, 6.0, "s")


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []

    def Export(self, request, context):  # noqa: N802
        self.requests.append(request)
        return ExportTraceServiceResponse()


def test_spans_reach_an_otlp_grpc_collector(tmp_path):
    service = TraceService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        tel = Telemetry.from_spec(otlp_spec(f"http://127.0.0.1:{port}", "grpc"), tmp_path, "actor")
        with tel.span(TRAIN_STEP, step=5):
            pass
        tel.shutdown()
    finally:
        server.stop(grace=None)
    assert [n for r in service.requests for n in span_names(r)] == [TRAIN_STEP]
    assert resource_of(service.requests[0])["relax.role"] == "actor"


@pytest.mark.parametrize(("endpoint", "url"), [
    ("collector:4318", "http://collector:4318/v1/traces"),
    ("http://collector:4318/", "http://collector:4318/v1/traces"),
    ("https://c.example/otlp/v1/metrics", "https://c.example/otlp/v1/traces"),
    ("https://c.example/custom/ingest", "https://c.example/custom/ingest"),
    (None, None),
])
def test_otlp_http_endpoints_get_the_signal_path(endpoint, url):
    assert otlp_http_url(endpoint, "traces") == url


def test_step_metrics_are_a_no_op_without_otlp():
    metrics = StepMetricsExporter.from_spec(RunSpec(name="r", tracing={"exporter": "jsonl"}))
    assert not metrics.enabled and metrics.provider is None
    metrics.export({"step": 1, "reward/mean": 1.0})
    metrics.shutdown()
