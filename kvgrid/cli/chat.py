"""`kvgrid chat`: an interactive conversation in the terminal.

The whole history travels with every turn (the server is stateless between
requests; its prefix cache makes the repeated history cheap). `/exit`, `/quit`
or Ctrl-D leave, `/reset` forgets the history, Ctrl-C stops the current reply.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from kvgrid.cli.connect import (
    add_connection_arguments,
    bad_connection_arguments,
    describe_error,
    metadata,
    open_channel,
)
from kvgrid.cli.generate import add_sampling_arguments, closed_stdout, sampling_from_args
from kvgrid.v1 import generate_pb2, generate_pb2_grpc

EXIT_COMMANDS = ("/exit", "/quit")
HELP = "commands: /reset forgets the conversation, /exit (or Ctrl-D) leaves, Ctrl-C stops a reply"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgrid chat", description="Chat with a kvgrid server in the terminal.")
    parser.add_argument("--system", default="", help="system message that opens the conversation")
    add_connection_arguments(parser)
    add_sampling_arguments(parser, max_tokens=512)
    return parser


class Conversation:
    def __init__(self, system: str):
        self.system = system
        self.messages: list[generate_pb2.ChatMessage] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [generate_pb2.ChatMessage(role="system", content=self.system)] if self.system else []

    def add(self, role: str, content: str) -> None:
        self.messages.append(generate_pb2.ChatMessage(role=role, content=content))


def reply(stub, conversation: Conversation, args: argparse.Namespace, out) -> str:
    """Stream the assistant's answer to `out` and return it; Ctrl-C keeps what arrived so far."""
    request = generate_pb2.ChatRequest(messages=conversation.messages, sampling=sampling_from_args(args))
    call = stub.Chat(request, timeout=args.timeout, metadata=metadata(args))
    parts: list[str] = []
    try:
        for response in call:
            parts.append(response.text)
            out.write(response.text)
            out.flush()
    except KeyboardInterrupt:
        call.cancel()
        out.write(" [stopped]")
    out.write("\n")
    return "".join(parts)


def read_line(interactive: bool) -> str | None:
    """One user line, or None at end of input."""
    try:
        return input("you> " if interactive else "")
    except EOFError:
        return None


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    bad = bad_connection_arguments("chat", args)
    if bad is not None:
        return bad
    try:
        return run(args)
    except BrokenPipeError:  # `kvgrid chat < questions.txt | head`
        return closed_stdout()


def run(args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    conversation = Conversation(args.system)
    if interactive:
        print(f"kvgrid chat with {args.addr}; {HELP}")
    with open_channel(args) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        while True:
            try:
                line = read_line(interactive)
            except KeyboardInterrupt:
                print()
                continue
            if line is None or line.strip() in EXIT_COMMANDS:
                if interactive:
                    print()
                return 0
            if not line.strip():
                continue
            if line.strip() == "/reset":
                conversation.reset()
                print("(conversation reset)")
                continue
            conversation.add("user", line)
            if interactive:
                sys.stdout.write("assistant> ")
            try:
                answer = reply(stub, conversation, args, sys.stdout)
            except grpc.RpcError as err:
                conversation.messages.pop()
                if interactive:
                    print()
                print(f"kvgrid chat: {describe_error(err, args.addr)}", file=sys.stderr)
                if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED):
                    return 1
                continue
            conversation.add("assistant", answer)
