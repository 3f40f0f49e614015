"""Control-plane throughput: real frontend and scheduler processes against a worker that takes a fixed time per step.

``python -m benchmarks.control_plane_bench --concurrency 256 --json``

The worker is ``benchmarks.fake_gpu_worker``: each step takes ``--step-ms`` (10 ms, a
GPU decode step of a small model) and samples deterministic tokens, so every
running request could get 1000/step_ms tokens per second: the ideal is
concurrency x 100 tok/s. Client processes stream ``Generate`` calls of
``--output-tokens`` tokens (ignore_eos) from the frontend(s), ``--concurrency``
at a time, back to back. Over a measuring window after a warm-up it reports the
output tokens the clients received per second against the ideal, the
scheduler's and frontends' CPU time per step (from /proc), inter-token latency
(the gap between two responses of a call, divided by the tokens the later one
carries) and time to first token.

``--code-path DIR`` runs the scheduler and frontend from another checkout (e.g.
main, for the before figures); ``--frontends 2`` starts two frontend replicas
and splits the clients between them. Figures depend on the machine and on
whatever else runs on it: compare runs made one after another.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.results import save
from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.common.default_model import default_model_path

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPT_WORDS = 12


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Stack:
    """Fake worker + scheduler + frontends as child processes, logging to a temp dir."""

    def __init__(self, args):
        self.args = args
        self.dir = tempfile.mkdtemp(prefix="kvgrid-cp-bench-")
        self.procs: dict[str, subprocess.Popen] = {}
        n = args.frontends
        ports = _free_ports(3 + 2 * n)
        self.worker_port, self.scheduler_port, self.scheduler_metrics_port = ports[:3]
        self.frontend_ports = ports[3 : 3 + n]
        self.http_ports = ports[3 + n :]

    def _spawn(self, name: str, argv: list[str], code_path: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRID_")}
        env.update(PYTHONPATH=code_path, KVGRID_LOG_LEVEL="warning", PYTHONUNBUFFERED="1")
        # cwd too: ``python -m`` puts the working directory ahead of PYTHONPATH.
        with open(os.path.join(self.dir, f"{name}.log"), "w") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=code_path
            )

    def start(self) -> None:
        a = self.args
        code = a.code_path or str(ROOT)
        self._spawn(
            "worker",
            [
                "-m",
                "benchmarks.fake_gpu_worker",
                "--port",
                str(self.worker_port),
                "--step-ms",
                str(a.step_ms),
                "--max-num-seqs",
                str(a.max_num_seqs),
            ],
            str(ROOT),
        )
        scheduler = [
            "-m",
            "kvgrid.cli",
            "scheduler",
            "--host",
            "127.0.0.1",
            "--scheduler-port",
            str(self.scheduler_port),
            "--scheduler-metrics-port",
            str(self.scheduler_metrics_port),
            "--worker-addr",
            f"127.0.0.1:{self.worker_port}",
            "--max-num-seqs",
            str(a.max_num_seqs),
            "--max-num-batched-tokens",
            str(max(2048, 2 * a.max_num_seqs)),
        ]
        if a.async_scheduling is not None:
            scheduler.append("--async-scheduling" if a.async_scheduling else "--no-async-scheduling")
        self._spawn("scheduler", scheduler, code)
        for i, (port, http) in enumerate(zip(self.frontend_ports, self.http_ports, strict=True)):
            self._spawn(
                f"frontend{i}",
                [
                    "-m",
                    "kvgrid.cli",
                    "tokenizer",
                    "--host",
                    "127.0.0.1",
                    "--tokenizer-port",
                    str(port),
                    "--http-port",
                    str(http),
                    "--scheduler-addr",
                    f"127.0.0.1:{self.scheduler_port}",
                    "--tokenizer",
                    default_model_path(),
                ],
                code,
            )

    async def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        for port in self.frontend_ports:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while True:
                    for name, proc in self.procs.items():
                        if proc.poll() is not None:
                            raise RuntimeError(f"{name} exited; see {self.dir}/{name}.log")
                    try:
                        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            break
                    except grpc.aio.AioRpcError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the stack is not serving after {timeout:.0f}s; logs in {self.dir}")
                    await asyncio.sleep(0.3)

    async def stats(self) -> scheduler_pb2.SchedulerStats:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.scheduler_port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            return await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)

    async def sample_queues(self, until: float, out: list[tuple[int, int]]) -> None:
        """(running, waiting) at the scheduler, every 0.25 s until ``until``."""
        while time.monotonic() < until:
            stats = await self.stats()
            out.append((stats.num_running, stats.num_waiting))
            await asyncio.sleep(0.25)

    def frontend_ttft_mean(self) -> float:
        """Mean time to first token as the frontends measure it (from the call's arrival), over the whole run."""
        total = count = 0.0
        for port in self.http_ports:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            for line in text.splitlines():
                if line.startswith("kvgrid_time_to_first_token_seconds_sum"):
                    total += float(line.rsplit(" ", 1)[1])
                elif line.startswith("kvgrid_time_to_first_token_seconds_count"):
                    count += float(line.rsplit(" ", 1)[1])
        return total / count if count else float("nan")

    def cpu(self) -> dict[str, float]:
        return {name: _cpu_seconds(p.pid) for name, p in self.procs.items()}

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


# ---- clients (each client process runs its share of the concurrent calls) ----


async def _client(addr: str, concurrency: int, output_tokens: int, window: tuple[float, float], seed: int) -> dict:
    stop_at = window[1]
    cpu: list[float] = []

    async def clock() -> None:  # this process's CPU time at the window's ends
        await asyncio.sleep(max(0.0, window[0] - time.monotonic()))
        cpu.append(time.process_time())
        await asyncio.sleep(max(0.0, window[1] - time.monotonic()))
        cpu.append(time.process_time())

    clock_task = asyncio.create_task(clock())
    responses: list[tuple[float, int]] = []  # (time, tokens) of every response
    gaps: list[float] = []  # per-token inter-token latency
    ttfts: list[float] = []
    num_errors = 0
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        sampling = common_pb2.SamplingParams(max_tokens=output_tokens, ignore_eos=True)

        async def slot(i: int) -> None:
            nonlocal num_errors
            n = 0
            while time.monotonic() < stop_at:
                prompt = " ".join(f"word{(seed * 7 + i * 13 + n * 31 + k) % 97}" for k in range(PROMPT_WORDS))
                request = generate_pb2.GenerateRequest(prompt=prompt, sampling=sampling)
                n += 1
                sent = last = time.monotonic()
                first = True
                try:
                    async for response in stub.Generate(request):
                        now = time.monotonic()
                        k = len(response.token_ids)
                        if not k:
                            continue
                        responses.append((now, k))
                        if first:
                            ttfts.append(now - sent)
                            first = False
                        else:
                            gaps.extend([(now - last) / k] * k)
                        last = now
                        if now >= stop_at:
                            return
                except grpc.aio.AioRpcError:
                    num_errors += 1
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(slot(i) for i in range(concurrency)))
    await clock_task
    return {"responses": responses, "gaps": gaps, "ttfts": ttfts, "errors": num_errors, "cpu": cpu[1] - cpu[0]}


def _client_process(addr, concurrency, output_tokens, window, seed, queue) -> None:
    queue.put(asyncio.run(_client(addr, concurrency, output_tokens, window, seed)))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def measure(args) -> dict:
    stack = Stack(args)
    stack.start()
    try:
        await stack.wait_ready()
        start = time.monotonic()
        window = (start + args.warmup, start + args.warmup + args.duration)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        procs = []
        for i in range(args.client_procs):
            share = args.concurrency // args.client_procs + (1 if i < args.concurrency % args.client_procs else 0)
            addr = f"127.0.0.1:{stack.frontend_ports[i % len(stack.frontend_ports)]}"
            p = ctx.Process(target=_client_process, args=(addr, share, args.output_tokens, window, i, queue))
            p.start()
            procs.append(p)
        await asyncio.sleep(max(0.0, window[0] - time.monotonic()))
        t0, cpu0, steps0 = time.monotonic(), stack.cpu(), (await stack.stats()).num_steps
        queues: list[tuple[int, int]] = []
        await stack.sample_queues(window[1], queues)
        t1, cpu1, steps1 = time.monotonic(), stack.cpu(), (await stack.stats()).num_steps
        results = [await asyncio.to_thread(queue.get) for _ in procs]
        frontend_ttft = stack.frontend_ttft_mean()
        for p in procs:
            p.join()
    finally:
        stack.stop()
    in_window = [(t, k) for r in results for t, k in r["responses"] if window[0] <= t < window[1]]
    tokens = sum(k for _, k in in_window)
    steps = max(steps1 - steps0, 1)
    elapsed = t1 - t0  # the window as the scheduler's counters saw it
    cpu = {name: cpu1[name] - cpu0[name] for name in cpu0}
    frontend_cpu = sum(v for name, v in cpu.items() if name.startswith("frontend"))
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [t for r in results for t in r["ttfts"]]
    delivered = tokens / args.duration
    ideal = args.concurrency * 1000.0 / args.step_ms
    return {
        "concurrency": args.concurrency,
        "output_tokens": args.output_tokens,
        "frontends": args.frontends,
        "code_path": args.code_path or str(ROOT),
        "async_scheduling": args.async_scheduling,
        "delivered_tok_s": round(delivered, 1),
        "ideal_tok_s": ideal,
        "fraction_of_ideal": round(delivered / ideal, 3),
        "steps_per_s": round(steps / elapsed, 1),
        "step_ms": round(1000 * elapsed / steps, 2),
        "scheduler_cpu_ms_per_step": round(1000 * cpu["scheduler"] / steps, 3),
        "frontend_cpu_ms_per_step": round(1000 * frontend_cpu / steps, 3),
        "scheduler_cpu_share": round(cpu["scheduler"] / elapsed, 3),
        "frontend_cpu_share": round(frontend_cpu / elapsed, 3),
        "mean_running": round(sum(r for r, _ in queues) / max(len(queues), 1), 1),
        "mean_waiting": round(sum(w for _, w in queues) / max(len(queues), 1), 1),
        "client_cpu_share": round(sum(r["cpu"] for r in results) / args.duration, 3),
        # The frontend's CPU per token a client received: what coalescing and the per-delta work cost.
        "frontend_cpu_us_per_token": round(1e6 * frontend_cpu / max(tokens * elapsed / args.duration, 1), 1),
        "client_cpu_us_per_token": round(1e6 * sum(r["cpu"] for r in results) / max(tokens, 1), 1),
        "tokens_per_response": round(tokens / max(len(in_window), 1), 2),
        "itl_p50_ms": round(1000 * _pct(gaps, 0.5), 2),
        "itl_p99_ms": round(1000 * _pct(gaps, 0.99), 2),
        "ttft_p50_ms": round(1000 * _pct(ttfts, 0.5), 1),
        "ttft_p99_ms": round(1000 * _pct(ttfts, 0.99), 1),
        "frontend_ttft_mean_ms": round(1000 * frontend_ttft, 1),
        "client_errors": sum(r["errors"] for r in results),
        "logs": stack.dir,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds before the measuring window")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of the measuring window")
    parser.add_argument("--frontends", type=int, default=1)
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--code-path", default="", help="run scheduler and frontends from this checkout")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", default="", help="write the JSON here (default: benchmarks/results/)")
    args = parser.parse_args(argv)
    args.max_num_seqs = max(args.concurrency, 128)
    result = asyncio.run(measure(args))
    save(f"control_plane_bench_c{args.concurrency}_f{args.frontends}", result, args.out or None)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
