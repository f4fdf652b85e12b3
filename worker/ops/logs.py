"""Logging for the worker process: one line per record to stderr, as text (time, level,
logger, message) or as JSON (``AGENT_LOG_FORMAT=json``: ``ts``, ``level``, ``logger``,
``msg``, and ``exc`` for a traceback). Values from the wire are escaped where they are
logged (``bus_redis.codec.safe``), so a record is always one line."""

from __future__ import annotations

import json
import logging
import sys
import time

NOISY = ("httpx", "httpx2", "httpcore", "openai")  # their request lines are not our turns


_encode = json.JSONEncoder(ensure_ascii=False).encode


class _Seconds(logging.Formatter):
    """``asctime`` with its date and time of day formatted once a second (a worker logs
    a line a turn); the format and the converter it was made with are part of the key."""

    _second: tuple[tuple[int, str | None, object], str] = ((-1, None, None), "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        key = (int(record.created), datefmt, self.converter)
        made, text = self._second
        if made != key:
            text = time.strftime(datefmt or "%Y-%m-%d %H:%M:%S", self.converter(key[0]))
            self._second = (key, text)
        return text if datefmt else f"{text},{int(record.msecs):03d}"


class JsonFormatter(_Seconds):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return _encode(doc)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(_Seconds("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # no format here prints the caller, thread or process: a record does not look them up
    # (the logging HOWTO's "Optimization"; the worker process's own logging only)
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)
