"""JSON logs on stderr, one line per event, with the service and worker ids bound: structlog's own events and
every stdlib logger's (aiohttp, nats, asyncio, transformers, Python warnings) through one formatter.

Handlers bind `request_id` with `structlog.contextvars.bound_contextvars(request_id=...)`.

- structlog events go to the stdlib logger "smartgen" at the service's level; other libraries' loggers reach
  the same handler at WARNING and above (aiohttp's access log aside: `access_log.py` writes it at INFO).
- Whatever still writes plain text to sys.stdout or sys.stderr (a print, a progress bar, a library's own handler
  made after this) becomes a `stray_output` event, one per line; an uncaught exception an `uncaught_exception`
  event with its traceback. Only a C extension writing to file descriptor 2 itself gets past this.
"""
from __future__ import annotations

import io
import logging
import os
import sys
import threading
from typing import Any

import structlog

LOGGER_NAME = "smartgen"
# NOTE: what runs before the renderer, for structlog's events and stdlib records alike
_SHARED = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
           structlog.processors.TimeStamper(fmt="iso", utc=True)]


def setup_logging(service: str, worker_id: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    numeric = getattr(logging, level.upper())
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # bars are \r-redrawn lines, not events
    ids = _Ids(service, worker_id)
    stream = sys.__stderr__  # NOTE: the real stderr; sys.stderr itself becomes a _LinesToLog below
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*_SHARED, ids, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer()]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger(LOGGER_NAME).setLevel(numeric)
    logging.captureWarnings(True)  # warnings.warn (torch's and transformers' included) → the "py.warnings" logger
    _route_transformers()
    structlog.configure(
        processors=[*_SHARED, ids, structlog.processors.format_exc_info,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=lambda *_: logging.getLogger(LOGGER_NAME),
        cache_logger_on_first_use=True,
    )
    sys.stdout = _LinesToLog("stdout", logging.INFO)
    sys.stderr = _LinesToLog("stderr", logging.WARNING)
    sys.excepthook = _log_uncaught
    threading.excepthook = lambda args: _log_uncaught(args.exc_type, args.exc_value, args.exc_traceback)
    return structlog.get_logger()


def _route_transformers() -> None:
    """transformers logs through a handler of its own on the stderr of its import, not to the root: send its
    records to ours instead, and turn its progress bars off. Where it is imported later, its handler writes to
    the sys.stderr of then, a _LinesToLog."""
    tf_logging = sys.modules.get("transformers.utils.logging")
    if tf_logging is not None:
        tf_logging.disable_default_handler()
        tf_logging.enable_propagation()
        tf_logging.disable_progress_bar()


class _Ids:
    """A processor adding the service and worker ids to every event, from any thread (contextvars bound in the
    main thread do not reach threads, such as the one torch runs on)."""

    def __init__(self, service: str, worker_id: str):
        self.service, self.worker_id = service, worker_id

    def __call__(self, _logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("service", self.service)
        event.setdefault("worker_id", self.worker_id)
        return event


class _LinesToLog(io.TextIOBase):
    """A text stream that logs each complete line written to it as a `stray_output` event."""

    def __init__(self, stream: str, level: int):
        self.stream, self.level = stream, level
        self._pending = ""
        self._lock = threading.Lock()
        self._busy = threading.local()  # NOTE: a failing handler writes to sys.stderr: no loop through here

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if getattr(self._busy, "on", False):
            return sys.__stderr__.write(text)
        with self._lock:
            *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            line = line.rsplit("\r", 1)[-1].rstrip()  # a redrawn line (\r): what it ended as
            if line:
                self._busy.on = True
                try:
                    structlog.get_logger().log(self.level, "stray_output", stream=self.stream, text=line)
                finally:
                    self._busy.on = False
        return len(text)

    def flush(self) -> None:
        pass


def _log_uncaught(exc_type: type[BaseException], exc: BaseException | None, tb: Any) -> None:
    try:
        if issubclass(exc_type, KeyboardInterrupt):  # Ctrl-C before the service's own handler: not a failure
            logging.getLogger(LOGGER_NAME).warning("interrupted", exc_info=(exc_type, exc, tb))
        else:
            logging.getLogger(LOGGER_NAME).critical("uncaught_exception", exc_info=(exc_type, exc, tb))
    except Exception:  # NOTE: logging itself broken (interpreter shutdown): the plain traceback beats none
        sys.__excepthook__(exc_type, exc, tb)
