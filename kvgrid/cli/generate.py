"""`kvgrid generate PROMPT`: stream one completion from a running stack to the terminal.

By default the prompt goes through `Chat` as one user message, which is what an
instruct model expects; `--raw` sends it through `Generate` as text to continue.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator

import grpc
from google.protobuf import json_format

from kvgrid.cli.connect import (  # noqa: F401 - chat and bench take them from here too
    ADDR_ENV,
    DEFAULT_ADDR,
    add_connection_arguments,
    bad_connection_arguments,
    describe_error,
    metadata,
    open_channel,
)
from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc

# What a shell reports for a command killed by SIGPIPE (128 + 13), as `seq 1000000 | head -1` does for seq.
EXIT_CLOSED_STDOUT = 141


class ClientError(Exception):
    """A failed call, already phrased for the terminal."""


def closed_stdout() -> int:
    """The reader of stdout went away (`kvgrid generate ... | head -1`): end quietly, with the status a
    command killed by SIGPIPE gets, so `set -o pipefail` scripts see what they see for `cat` or `seq`.

    Python ignores SIGPIPE, so the write raised BrokenPipeError; what is still buffered would be flushed
    again at exit and fail again ("Exception ignored ... BrokenPipeError"): stdout's descriptor now
    points at /dev/null, so that last flush goes nowhere."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # replaced by something without a descriptor
        return EXIT_CLOSED_STDOUT
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return EXIT_CLOSED_STDOUT


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens, help=f"most tokens to generate ({max_tokens})")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    group.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling mass in (0, 1] (default 1)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p times the best one")
    group.add_argument("--seed", type=int, default=None, help="sampler seed, for reproducible sampling")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_from_args(args: argparse.Namespace) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.seed is not None:
        params.seed = args.seed
    return params


def stream_calls(
    stub: generate_pb2_grpc.TextGenerationStub, request, timeout: float | None, call_metadata=()
) -> Iterator[generate_pb2.GenerateResponse]:
    """Responses of a Generate or Chat call; cancels the call if the consumer stops early."""
    method = stub.Chat if isinstance(request, generate_pb2.ChatRequest) else stub.Generate
    call = method(request, timeout=timeout, metadata=call_metadata)
    try:
        yield from call
    finally:
        call.cancel()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgrid generate", description="Stream a completion from a kvgrid server.")
    parser.add_argument("prompt", help="the prompt ('-' reads it from stdin)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="raw", action="store_false", help="send as one user message (default)")
    mode.add_argument("--raw", dest="raw", action="store_true", help="complete the text as is (Generate)")
    parser.set_defaults(raw=False)
    parser.add_argument("--system", default="", help="system message for chat mode")
    parser.add_argument("--json", action="store_true", help="print each streamed message as one JSON line")
    add_connection_arguments(parser)
    add_sampling_arguments(parser, max_tokens=256)
    return parser


def build_request(args: argparse.Namespace, prompt: str):
    sampling = sampling_from_args(args)
    if args.raw:
        return generate_pb2.GenerateRequest(prompt=prompt, sampling=sampling)
    messages = [generate_pb2.ChatMessage(role="system", content=args.system)] if args.system else []
    messages.append(generate_pb2.ChatMessage(role="user", content=prompt))
    return generate_pb2.ChatRequest(messages=messages, sampling=sampling)


def no_chat_template(err: grpc.RpcError) -> bool:
    return err.code() == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in (err.details() or "")


class Printer:
    """Writes streamed messages as text (or JSON lines) and remembers how the stream ended."""

    def __init__(self, as_json: bool, call_metadata=()):
        self.as_json = as_json
        self.metadata = call_metadata
        self.wrote = False
        self.finish = ""

    def run(self, stub, request, timeout: float | None) -> None:
        for response in stream_calls(stub, request, timeout, self.metadata):
            if self.as_json:
                print(json.dumps(json_format.MessageToDict(response)), flush=True)
            else:
                sys.stdout.write(response.text)
                sys.stdout.flush()
            self.wrote = self.wrote or bool(response.text) or self.as_json
            self.finish = response.finish_reason or self.finish


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    bad = bad_connection_arguments("generate", args)
    if bad is not None:
        return bad
    try:
        return run(args)
    except BrokenPipeError:
        return closed_stdout()


def run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    request = build_request(args, prompt)
    printer = Printer(args.json, metadata(args))
    with open_channel(args) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        try:
            try:
                printer.run(stub, request, args.timeout)
            except grpc.RpcError as err:
                if printer.wrote or not isinstance(request, generate_pb2.ChatRequest) or not no_chat_template(err):
                    raise
                print("kvgrid generate: the model has no chat template; completing the raw text", file=sys.stderr)
                printer.run(stub, generate_pb2.GenerateRequest(prompt=prompt, sampling=request.sampling), args.timeout)
        except grpc.RpcError as err:
            if printer.wrote and not args.json:
                sys.stdout.write("\n")
            print(f"kvgrid generate: {describe_error(err, args.addr)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nkvgrid generate: interrupted", file=sys.stderr)
            return 130
    if not args.json:
        sys.stdout.write("\n")
    if printer.finish == "abort":
        print("kvgrid generate: the server aborted the request", file=sys.stderr)
        return 1
    return 0
