"""Spans as JSON lines: the exporter behind ``tracing.exporter: jsonl`` and its reader.

One compact JSON object per span per line::

    {"name": "relax.rollout.batch", "trace_id": "<32 hex>", "span_id": "<16 hex>",
     "parent_id": "<16 hex>" | null, "start": <ns since epoch>, "end": <ns>, "kind": "INTERNAL",
     "status": "UNSET" | "OK" | "ERROR", "attributes": {...},
     "links": [{"trace_id": ..., "span_id": ..., "attributes": {...}}],
     "events": [{"name": ..., "time": <ns>, "attributes": {...}}], "resource": {...}}

Every process of a run appends to the same file. The file is opened with ``O_APPEND`` and each
batch of whole lines goes out in one ``write`` (batches are cut at ``max_write_bytes``), so lines
of different processes never interleave on a local file system (Linux serializes writes to one
file; network file systems such as NFS do not promise this).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

TRACES_FILE = "traces.jsonl"
#: Largest single write: many whole lines; a longer line is written alone.
MAX_WRITE_BYTES = 1 << 20


def _hex_span(span_id: int) -> str:
    return f"{span_id:016x}"


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """The JSON-ready record of one finished span (the format above)."""
    ctx = span.context
    record: dict[str, Any] = {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": _hex_span(ctx.span_id),
        "parent_id": _hex_span(span.parent.span_id) if span.parent is not None else None,
        "start": span.start_time,
        "end": span.end_time,
        "kind": span.kind.name,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "links": [{"trace_id": f"{link.context.trace_id:032x}", "span_id": _hex_span(link.context.span_id),
                   "attributes": dict(link.attributes or {})} for link in span.links],
        "events": [{"name": event.name, "time": event.timestamp, "attributes": dict(event.attributes or {})}
                   for event in span.events],
        "resource": dict(span.resource.attributes),
    }
    if span.status.description:
        record["status_message"] = span.status.description
    return record


def _line(span: ReadableSpan) -> bytes:
    return (json.dumps(span_to_dict(span), separators=(",", ":"), default=str) + "\n").encode()


class JsonlSpanExporter(SpanExporter):
    """Appends each span as one JSON line to ``path``; safe for many processes on one file."""

    def __init__(self, path: str | Path, max_write_bytes: int = MAX_WRITE_BYTES) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_write_bytes = max_write_bytes
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [_line(span) for span in spans]
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            try:
                for chunk in _chunks(lines, self.max_write_bytes):
                    _write_all(self._fd, chunk)
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # each export is already in the kernel's hands

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _chunks(lines: list[bytes], limit: int) -> list[bytes]:
    chunks: list[bytes] = []
    current: list[bytes] = []
    size = 0
    for line in lines:
        if current and size + len(line) > limit:
            chunks.append(b"".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        chunks.append(b"".join(current))
    return chunks


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # a regular file takes it whole; loop only for a short write (disk full, signal)
        view = view[os.write(fd, view):]


def read_spans(path: str | Path) -> list[dict[str, Any]]:
    """The span records of a traces file, in file order.

    A truncated last line (a process killed mid-write) is skipped; a bad line elsewhere raises
    ``ValueError`` naming the file and line.
    """
    path = Path(path)
    text = path.read_text()
    lines = text.split("\n")
    spans = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            spans.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise ValueError(f"{path}:{number} is not a JSON span record ({exc.msg}); was the file edited?") from None
    return spans
