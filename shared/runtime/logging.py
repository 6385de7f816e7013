"""structlog JSON logs on stderr, one line per event, with the service and worker ids bound.

Handlers bind `request_id` with `structlog.contextvars.bound_contextvars(request_id=...)`.
"""
from __future__ import annotations

import logging
import sys

import structlog


def setup_logging(service: str, worker_id: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    numeric = getattr(logging, level.upper())
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service, worker_id=worker_id)
    return structlog.get_logger()
