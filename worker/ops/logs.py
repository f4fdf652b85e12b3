"""Logging for the worker process: one line per record to stderr, as text (time, level,
logger, message) or as JSON (``AGENT_LOG_FORMAT=json``: ``ts``, ``level``, ``logger``,
``msg``, and ``exc`` for a traceback). Values from the wire are escaped where they are
logged (``bus_redis.codec.safe``), so a record is always one line."""

from __future__ import annotations

import json
import logging
import sys

NOISY = ("httpx", "httpx2", "httpcore", "openai")  # their request lines are not our turns


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)
