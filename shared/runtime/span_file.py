"""Finished spans as JSON lines in a file that every process of a stack may share (SMARTGEN_TRACING_FILE).

One line per span, OpenTelemetry's own JSON of it (`ReadableSpan.to_json`: name, context.trace_id and span_id,
parent_id, kind, times, attributes, resource.attributes with service.name), written with one `write` to a file
opened for appending, so lines from several processes never interleave.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class JsonLinesExporter(SpanExporter):
    def __init__(self, path: str):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.fd is None:
            return SpanExportResult.FAILURE
        for span in spans:
            os.write(self.fd, (span.to_json(indent=None) + "\n").encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_spans(path: str | Path) -> list[dict[str, Any]]:
    """Every span a JsonLinesExporter wrote to `path`, in the order they ended."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]
