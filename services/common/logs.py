"""Logging setup: readable text lines by default, one JSON object per line with --log-format json."""

from __future__ import annotations

import json
import logging
import os
import sys
import time


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str = ""):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": getattr(record, "service", None) or self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("request_id", "trace_id"):
            if hasattr(record, key):
                out[key] = getattr(record, key)
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def disable_progress_bars() -> None:
    """Progress bars (tqdm, e.g. while weights load) are not log lines. tqdm reads TQDM_* variables when it
    is first imported, so call this before importing a service (torch imports tqdm)."""
    os.environ.setdefault("TQDM_DISABLE", "1")


def setup_logging(service: str, level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # warnings become log lines in the chosen format
    logging.getLogger("grpc").setLevel(logging.WARNING)


class RequestLog(logging.LoggerAdapter):
    """A logger that tags every line with the request id (a field in JSON, a prefix in text)."""

    def process(self, msg, kwargs):
        rid = self.extra["request_id"]
        kwargs.setdefault("extra", {})["request_id"] = rid
        return f"[{rid}] {msg}", kwargs


def request_log(logger: logging.Logger, request_id: str) -> RequestLog:
    return RequestLog(logger, {"request_id": request_id})
