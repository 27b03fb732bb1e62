"""How a service process logs: its level, and lines of text or JSON objects.

Every service takes `--log-level` (DEBUG, INFO, WARNING, ERROR) and `--log-format` (`text`,
the default, or `json`: one object a line, for a log pipeline to parse), each defaulting to
its environment variable as the service's other flags do. A JSON line carries the trace and
span ids of the span current when it was logged, so a log line leads to its trace in Jaeger.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from opentelemetry import trace

from services.common.serving.flags import Flag

TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")


@dataclass(frozen=True)
class LogSettings:
    level: str = "INFO"
    format: str = "text"


def add_log_flags(flag: Flag, parser: argparse.ArgumentParser) -> None:
    """`--log-level` and `--log-format` on a service's parser."""
    flag(parser, "log-level", "INFO", f"the least severe level logged: {', '.join(LEVELS)}")
    flag(parser, "log-format", "text", "log lines as `text` or `json` (one object a line)")


def read_log_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> LogSettings:
    """The parsed flags as settings; a usage error (exit 2) names a bad value."""
    level, fmt = args.log_level.upper(), args.log_format.lower()
    if level not in LEVELS:
        parser.error(f"--log-level takes one of {', '.join(LEVELS)}, got {args.log_level!r}")
    if fmt not in FORMATS:
        parser.error(f"--log-format takes text or json, got {args.log_format!r}")
    return LogSettings(level, fmt)


def configure_logging(settings: LogSettings) -> None:
    """Send the process's log records to stderr at `settings.level`, in its format (replacing
    any handler the root logger had)."""
    handler = logging.StreamHandler()
    if settings.format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=settings.level, handlers=[handler], force=True)


class JsonFormatter(logging.Formatter):
    """A record as one JSON object: time (UTC, ISO 8601), level, logger, message, the current
    span's trace and span ids where one is recording, and the traceback of an exception."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            line["trace_id"] = trace.format_trace_id(context.trace_id)
            line["span_id"] = trace.format_span_id(context.span_id)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)
