"""``kvgrid run-batch -i requests.jsonl -o results.jsonl``: an OpenAI batch file through ``LLM`` in this process.

This module only reads and writes lines. Each line's body is parsed with the HTTP API's request models,
prepared by the same code as ``/v1/completions`` and ``/v1/chat/completions`` (the front door) and
answered by the same renderers, so a line and an HTTP request with the same body get the same answer or
the same error. Every line is checked first; the good ones then run together as one offline batch, and
one result line is written per input line, in input order.

Input line: ``{"custom_id": ..., "method": "POST", "url": "/v1/completions", "body": {...}}``. Output
line: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``. A body the
HTTP route would refuse gets that route's status and error body in ``response`` and the error's code and
message in ``error``; a line that is not a request at all (not JSON, no custom_id, another url) has
``"response": null``. ``-`` reads stdin / writes stdout; the progress bar goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from dataclasses import dataclass, field

import pydantic

from kvgrid.offline.options import SECTIONS
from services.common import config as cfg
from services.common.errors import InvalidArgument, KvgridError
from services.common.logs import setup_logging
from services.tokenizer.openai.errors import error_body, invalid_body
from services.tokenizer.openai.prepare import PreparedOpenAI, prepare_chat, prepare_completion
from services.tokenizer.openai.protocol import ChatCompletionRequest, CompletionRequest

ROUTES = {
    "/v1/completions": (CompletionRequest, prepare_completion),
    "/v1/chat/completions": (ChatCompletionRequest, prepare_chat),
}


class BadLine(ValueError):
    """A line that is not a batch request at all; ``custom_id`` when the line had one."""

    def __init__(self, message: str, custom_id: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.custom_id = custom_id
        self.code = code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgrid run-batch",
        description="Run an OpenAI batch file (JSONL of /v1/completions and /v1/chat/completions requests) offline.",
    )
    parser.add_argument("-i", "--input-file", required=True, help="batch file to read ('-': stdin)")
    parser.add_argument("-o", "--output-file", required=True, help="where to write the results ('-': stdout)")
    cfg.add_arguments(parser, (*SECTIONS, cfg.ObservabilityConfig))
    return parser


def read_lines(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def write_lines(path: str, lines: list[str]) -> None:
    text = "".join(line + "\n" for line in lines)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


@dataclass(slots=True)
class BatchLine:
    """One input line: its request prepared (the HTTP route's own preparation), or why it cannot run."""

    custom_id: str | None
    prepared: PreparedOpenAI | None = None
    error: dict | None = None  # {"code", "message"}, and the HTTP answer in ``response`` when the body was at fault
    response: dict | None = None
    admitted: list = field(default_factory=list)  # the LLM's requests, one per choice


def run(llm, lines: list[str]) -> tuple[list[str], int]:
    """Output lines, one per non-blank input line, and how many of them are errors."""
    batch = asyncio.run(_prepare_all(llm, lines))
    for line in batch:
        if line.prepared is not None:
            try:
                line.admitted = [llm.admit(choice.request) for choice in line.prepared.choices]
            except KvgridError as exc:
                _fail(line, exc, None)
    admitted = [a for line in batch for a in line.admitted]
    responses = iter(llm.run_responses(admitted))
    outputs = []
    for line in batch:
        if line.error is None:
            renderer = line.prepared.renderer
            for choice in line.prepared.choices:
                renderer.add(choice.index, next(responses))
            body = renderer.response().model_dump()
            line.response = {"status_code": 200, "request_id": renderer.request_id, "body": body}
        outputs.append(_output_line(line))
    return outputs, sum(line.error is not None for line in batch)


async def _prepare_all(llm, lines: list[str]) -> list[BatchLine]:
    out: list[BatchLine] = []
    seen: dict[str, int] = {}
    for line_no, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            custom_id, url, body = _envelope(text)
        except BadLine as exc:
            out.append(BatchLine(exc.custom_id, error={"code": exc.code, "message": f"line {line_no}: {exc}"}))
            continue
        line = BatchLine(custom_id)
        out.append(line)
        if custom_id in seen:
            where = f"custom_id: {custom_id!r} is used on line {seen[custom_id]} already"
            line.error = {"code": "invalid_request", "message": f"line {line_no}: {where}"}
            continue
        seen[custom_id] = line_no
        model, prepare = ROUTES[url]
        try:
            request = model.model_validate(body)
            if request.stream:
                raise InvalidArgument("stream", "a batch line is answered whole: leave stream out or false")
            line.prepared = await prepare(request, llm.front_door, llm.model_name)
        except pydantic.ValidationError as exc:
            _fail(line, *invalid_body(exc.errors()))
        except KvgridError as exc:
            _fail(line, exc, getattr(exc, "public_field", None) or getattr(exc, "field", None))
    return out


def _envelope(text: str) -> tuple[str, str, dict]:
    try:
        item = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadLine(f"not valid JSON: {e}") from None
    if not isinstance(item, dict):
        raise BadLine("a line must be a JSON object with custom_id, method, url and body")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine("custom_id: must be a non-empty string")
    if item.get("method", "POST") != "POST":
        raise BadLine(f"method: only POST is supported, got {item.get('method')!r}", custom_id)
    url, body = item.get("url"), item.get("body")
    if url not in ROUTES:
        raise BadLine(f"url: must be one of {', '.join(ROUTES)}, got {url!r}", custom_id, "unsupported_url")
    if not isinstance(body, dict):
        raise BadLine("body: must be a JSON object", custom_id)
    return custom_id, url, body


def _fail(line: BatchLine, exc: KvgridError, param: str | None) -> None:
    """The line gets what the HTTP route would have answered for the same body."""
    status, body = error_body(exc, param)
    line.prepared, line.admitted = None, []
    line.response = {"status_code": status, "request_id": None, "body": body.model_dump()}
    line.error = {"code": body.error.code, "message": body.error.message}


def _output_line(line: BatchLine) -> str:
    out = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": line.response}
    out["error"] = line.error
    return json.dumps(out, ensure_ascii=False)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = cfg.build_config((*SECTIONS, cfg.ObservabilityConfig), args)
    except cfg.ConfigError as e:
        for line in str(e).splitlines():
            print(f"kvgrid run-batch: {line}", file=sys.stderr)
        return 2
    setup_logging("run-batch", config.observability.log_level, config.observability.log_format)
    try:
        lines = read_lines(args.input_file)
    except OSError as e:
        print(f"kvgrid run-batch: cannot read {args.input_file}: {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        from kvgrid.offline.llm import LLM
        from services.worker.setup.loader import ModelLoadError
        from services.worker.setup.memory import InsufficientMemory
    except ModuleNotFoundError as e:
        print(
            f"kvgrid run-batch: needs the worker's packages ({e.name} is missing): pip install 'kvgrid[worker]'",
            file=sys.stderr,
        )
        return 1
    started = time.perf_counter()
    try:
        llm = LLM.from_config(config)
    except (ModelLoadError, InsufficientMemory) as e:
        print(f"kvgrid run-batch: {e}", file=sys.stderr)
        return 1
    outputs, num_failed = run(llm, lines)
    try:
        write_lines(args.output_file, outputs)
    except OSError as e:
        print(f"kvgrid run-batch: cannot write {args.output_file}: {e.strerror or e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - started
    print(
        f"kvgrid run-batch: {len(outputs) - num_failed} requests done, {num_failed} lines failed "
        f"(their lines carry the error), in {seconds:.1f} s",
        file=sys.stderr,
    )
    return 0
