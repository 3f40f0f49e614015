"""`kvgrid generate`, `kvgrid chat` and `kvgrid bench` against an in-process fake TextGeneration server."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest

from kvgrid.cli import bench, chat
from kvgrid.cli import generate as client
from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc

REPLY = ["Hel", "lo", " wörld"]


class FakeTextGeneration(generate_pb2_grpc.TextGenerationServicer):
    """Streams REPLY one piece per message (token id = piece index), each after `delay` seconds; prompt 'bad'
    is rejected, and the prompt (or last chat message) 'endless' streams until the client cancels."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.requests: list = []
        self.cancelled = threading.Event()  # an endless stream ended because its client went away

    def _endless(self, context):
        # Called however the RPC ends (here: only by the client going away); the generator itself may never be
        # resumed after a cancel, so code after its loop would not run.
        context.add_callback(self.cancelled.set)
        while context.is_active():
            yield generate_pb2.GenerateResponse(text="word ", token_ids=[300])
            time.sleep(0.01)

    def _stream(self, request, context):
        self.requests.append(request)
        text = request.messages[-1].content if isinstance(request, generate_pb2.ChatRequest) else request.prompt
        if text == "endless":
            yield from self._endless(context)
            return
        if getattr(request, "prompt", "") == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature: must be >= 0")
        if isinstance(request, generate_pb2.ChatRequest) and request.messages[-1].content == "base model":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "messages: the model's tokenizer has no chat template")
        n = request.sampling.max_tokens or 16
        num_prompt = len(getattr(request, "prompt_token_ids", ())) or 4
        pieces = REPLY[:n]
        for i, piece in enumerate(pieces):
            time.sleep(self.delay)
            last = i == len(pieces) - 1
            yield generate_pb2.GenerateResponse(
                text=piece,
                token_ids=[300 + i],
                finish_reason="length" if last else "",
                usage=common_pb2.Usage(prompt_tokens=num_prompt, completion_tokens=i + 1) if last else None,
            )

    def Generate(self, request, context):
        yield from self._stream(request, context)

    def Chat(self, request, context):
        yield from self._stream(request, context)

    def GetModelInfo(self, request, context):
        return generate_pb2.ModelInfo(model="fake", vocab_size=1000, max_model_len=2048)


def serve_fake(servicer: FakeTextGeneration):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    generate_pb2_grpc.add_TextGenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture(scope="module")
def fake_server():
    yield from serve_fake(FakeTextGeneration())


@pytest.fixture(scope="module")
def slow_server():
    """Each request takes about 0.3 s (three messages 0.1 s apart)."""
    yield from serve_fake(FakeTextGeneration(delay=0.1))


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def kvgrid_into_closing_pipe(argv: list[str], stdin: str = "") -> tuple[int, bytes]:
    """Run `kvgrid ARGV | head -c 1`: stdout's reader closes after the first bytes. Returns (exit code, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgrid.cli", *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdin.write(stdin.encode())
    proc.stdin.close()
    assert os.read(proc.stdout.fileno(), 16), "no output before stdout closed"
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=60), err


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_generate_sends_one_chat_message_by_default_and_streams_text(fake_server, capsys):
    servicer, addr = fake_server
    argv = ["What?", "--addr", addr, "--max-tokens", "3", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "7"]
    assert client.main([*argv, "--seed", "11", "--stop", "END", "--system", "Be brief."]) == 0
    assert capsys.readouterr().out == "Hello wörld\n"
    request = servicer.requests[-1]
    assert isinstance(request, generate_pb2.ChatRequest)
    assert [(m.role, m.content) for m in request.messages] == [("system", "Be brief."), ("user", "What?")]
    s = request.sampling
    assert (s.max_tokens, s.top_k, list(s.stop), s.seed) == (3, 7, ["END"], 11)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)


def test_generate_raw_uses_generate_and_json_prints_each_message(fake_server, capsys):
    servicer, addr = fake_server
    assert client.main(["Once upon", "--raw", "--json", "--addr", addr, "--max-tokens", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    request = servicer.requests[-1]
    assert isinstance(request, generate_pb2.GenerateRequest) and request.prompt == "Once upon"
    assert not request.sampling.HasField("seed")
    assert [line["text"] for line in lines] == ["Hel", "lo"]
    assert lines[-1]["finishReason"] == "length"


def test_generate_reports_a_server_error_in_one_line(fake_server, capsys):
    _, addr = fake_server
    assert client.main(["bad", "--raw", "--addr", addr]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "kvgrid generate: INVALID_ARGUMENT: sampling.temperature: must be >= 0"


def test_generate_falls_back_to_raw_text_without_a_chat_template(fake_server, capsys):
    servicer, addr = fake_server
    assert client.main(["base model", "--addr", addr, "--max-tokens", "1"]) == 0
    out, err = capsys.readouterr()
    assert out == "Hel\n" and "no chat template" in err
    assert isinstance(servicer.requests[-1], generate_pb2.GenerateRequest)
    assert servicer.requests[-1].prompt == "base model" and servicer.requests[-1].sampling.max_tokens == 1


def test_generate_against_a_closed_port_says_so_without_a_traceback():
    addr = f"127.0.0.1:{closed_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "kvgrid.cli", "generate", "hello", "--addr", addr],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"kvgrid generate: cannot reach a kvgrid server at {addr} (is `kvgrid serve` running? pass --addr HOST:PORT)"
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [[], ["--json"], ["--raw"]])
def test_generate_into_a_closed_pipe_ends_quietly_and_cancels_the_call(fake_server, mode):
    servicer, addr = fake_server
    servicer.cancelled.clear()
    code, err = kvgrid_into_closing_pipe(["generate", "endless", "--addr", addr, *mode])
    assert err.decode() == ""  # no BrokenPipeError traceback, nor "Exception ignored" at exit
    assert code == client.EXIT_CLOSED_STDOUT == 141
    assert servicer.cancelled.wait(10), "the server's stream was not cancelled"


@pytest.mark.timeout(120)
def test_chat_into_a_closed_pipe_ends_quietly(fake_server):
    servicer, addr = fake_server
    servicer.cancelled.clear()
    code, err = kvgrid_into_closing_pipe(["chat", "--addr", addr], stdin="endless\nnot sent\n")
    assert (code, err.decode()) == (141, "")
    assert servicer.cancelled.wait(10), "the server's stream was not cancelled"


def test_chat_keeps_the_history_and_reset_forgets_it(fake_server, capsys, monkeypatch):
    servicer, addr = fake_server
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nand then?\n/reset\nagain\n/exit\nnot sent\n"))
    before = len(servicer.requests)
    assert chat.main(["--addr", addr, "--system", "S", "--max-tokens", "2"]) == 0
    sent = servicer.requests[before:]
    assert [[(m.role, m.content) for m in r.messages] for r in sent] == [
        [("system", "S"), ("user", "hi")],
        [("system", "S"), ("user", "hi"), ("assistant", "Hello"), ("user", "and then?")],
        [("system", "S"), ("user", "again")],
    ]
    assert capsys.readouterr().out.splitlines() == ["Hello", "Hello", "(conversation reset)", "Hello"]


def test_chat_ends_at_end_of_input(fake_server, monkeypatch):
    _, addr = fake_server
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert chat.main(["--addr", addr]) == 0


def test_bench_counts_every_token_and_request(fake_server, capsys):
    servicer, addr = fake_server
    before = len(servicer.requests)
    argv = ["--addr", addr, "-n", "6", "-c", "2", "--input-len", "10", "--output-len", "3", "--json"]
    assert bench.main(argv) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert err == ""  # stderr is no terminal here: no progress bar
    sent = servicer.requests[before:]
    assert len(sent) == 6
    assert all(len(r.prompt_token_ids) == 10 and r.sampling.ignore_eos for r in sent)
    assert all(bench.FIRST_PLAIN_TOKEN_ID <= t < 1000 for r in sent for t in r.prompt_token_ids)
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert (summary["input_tokens"], summary["output_tokens"]) == (60, 18)
    assert summary["request_throughput"] > 0 and summary["ttft_ms"]["p99"] >= summary["ttft_ms"]["p50"] > 0


@pytest.mark.timeout(120)
def test_bench_shows_progress_on_stderr_as_requests_finish(slow_server):
    _, addr = slow_server
    argv = ["bench", "--addr", addr, "-n", "4", "-c", "1", "--input-len", "4", "--output-len", "3", "--force-tqdm"]
    proc = subprocess.Popen([sys.executable, "-m", "kvgrid.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = b""
    while b"1/4" not in seen:
        chunk = os.read(proc.stderr.fileno(), 4096)
        assert chunk, f"stderr ended before one request was counted: {seen!r}"
        seen += chunk
    assert proc.poll() is None, "the first request was counted only when the run ended"
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert b"4/4" in seen + err and b"requests completed" not in seen + err
    report = out.decode().splitlines()
    assert report[0] == "requests completed          4 (0 failed)" and len(report) == 10, report


def test_bench_bar_follows_the_terminal_and_disable_tqdm(fake_server, monkeypatch, capsys):
    _, addr = fake_server
    for flags, shown in (([], True), (["--disable-tqdm"], False)):
        terminal = FakeTerminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        assert bench.main(["--addr", addr, "-n", "2", "--input-len", "4", "--output-len", "2", "--json", *flags]) == 0
        assert json.loads(capsys.readouterr().out)["completed"] == 2
        assert ("2/2" in terminal.getvalue()) is shown, (flags, terminal.getvalue())


def test_bench_report_has_the_headline_numbers():
    results = [bench.RequestResult(prompt_tokens=5, output_tokens=4, ttft=0.1, e2e=0.4, itls=[0.1, 0.1, 0.1])]
    results.append(bench.RequestResult(error="UNAVAILABLE: down"))
    summary = bench.summarize(results, duration=2.0)
    assert summary["output_throughput"] == pytest.approx(2.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(100.0)
    report = bench.format_report(summary)
    for text in ("1 (1 failed)", "request throughput", "2.0 tok/s", "TTFT", "ITL", "error: UNAVAILABLE: down"):
        assert text in report


def test_percentile_interpolates_like_numpy():
    values = [float(v) for v in range(1, 11)]
    assert bench.percentile(values, 50) == pytest.approx(5.5)
    assert bench.percentile(values, 90) == pytest.approx(9.1)
    assert bench.percentile(values, 99) == pytest.approx(9.91)
    assert bench.percentile([], 50) == 0.0


def test_bench_rejects_bad_arguments(capsys):
    assert bench.main(["-n", "0", "--range-ratio", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "--num-requests must be >= 1" in err and "--range-ratio" in err
