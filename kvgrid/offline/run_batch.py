"""``kvgrid run-batch -i requests.jsonl -o results.jsonl``: an OpenAI batch file through ``LLM`` in this process.

Every line is checked first; the good ones then run together as one offline batch, and one
result line is written per input line, in input order. A bad line gets an error line of its
own and the rest still run. ``-`` reads stdin / writes stdout; the progress bar goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvgrid.offline.openai_batch import COMPLETIONS, BadLine, BatchRequest, output_line, parse_line, response_body
from kvgrid.offline.options import SECTIONS
from services.common import config as cfg
from services.common.logs import setup_logging


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


def run(llm, lines: list[str]) -> tuple[list[str], int]:
    """Output lines, one per non-blank input line, and how many of them are errors."""
    outputs: list[str | None] = []
    requests: list[tuple[int, BatchRequest]] = []
    prepared = []
    seen: dict[str, int] = {}
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            request = parse_line(line, llm.max_model_len)
            if request.custom_id in seen:
                where = seen[request.custom_id]
                raise BadLine(f"custom_id: {request.custom_id!r} is used on line {where} already", request.custom_id)
            seen[request.custom_id] = line_no
            if request.url == COMPLETIONS:
                prepared.append(llm.prepare(request.prompt, request.sampling))
            else:
                prepared.append(llm.prepare_chat(request.messages, request.sampling))
        except ValueError as e:
            custom_id = e.custom_id if isinstance(e, BadLine) else request.custom_id
            outputs.append(output_line(custom_id, error=_on_line(line_no, e)))
            continue
        requests.append((len(outputs), request))
        outputs.append(None)
    results = llm.run(prepared)
    for (slot, request), p, result in zip(requests, prepared, results, strict=True):
        body = response_body(request, result, llm.model_name)
        outputs[slot] = output_line(request.custom_id, p.request.request_id, body)
    return outputs, len(outputs) - len(requests)


def _on_line(line_no: int, error: ValueError) -> BadLine:
    code = error.code if isinstance(error, BadLine) else "invalid_request"
    return BadLine(f"line {line_no}: {error}", code=code)


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
