"""The worker's log formatters (``worker.ops.logs``): the time of day formatted once a
second reads as ``logging.Formatter``'s own, whatever the record's second, its
milliseconds or the converter."""

from __future__ import annotations

import json
import logging
import time

from worker.ops.logs import JsonFormatter, _Seconds

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _record(created: float) -> logging.LogRecord:
    record = logging.LogRecord("worker", logging.INFO, "f.py", 1, "turn of %s", ("web:c1",), None)
    record.created, record.msecs = created, (created - int(created)) * 1000
    return record


def test_the_time_of_day_reads_as_logging_formatters() -> None:
    theirs, ours = logging.Formatter(FORMAT), _Seconds(FORMAT)
    start = 1_764_633_599.0  # a second before midnight UTC
    for created in (start, start + 0.001, start + 0.999, start + 1.0, start + 1.5, start + 86_400):
        assert ours.format(_record(created)) == theirs.format(_record(created))
    an_hour_east = lambda seconds: time.gmtime((seconds or 0) + 3600)  # noqa: E731
    for converter in (time.gmtime, an_hour_east):  # a converter set later counts at once
        theirs.converter = ours.converter = converter  # type: ignore[method-assign]
        assert ours.format(_record(start + 0.25)) == theirs.format(_record(start + 0.25))


def test_json_lines_carry_the_same_time() -> None:
    record = _record(1_764_633_599.125)
    doc = json.loads(JsonFormatter().format(record))
    expected = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(1_764_633_599)) + ".125"
    assert doc == {"ts": expected, "level": "INFO", "logger": "worker", "msg": "turn of web:c1"}
