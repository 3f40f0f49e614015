"""The ``kvgrid`` command: one subcommand per service, plus a launcher and clients.

Service modules are imported only when their subcommand runs, so that
``kvgrid scheduler`` and ``kvgrid tokenizer`` never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from services.common import config as cfg
from services.common.logs import disable_progress_bars

# subcommand -> (module with `main(config) -> int`, config sections it takes, help)
SERVICES = {
    "serve": ("kvgrid.cli.serve", cfg.ALL_SECTIONS, "start worker, scheduler and tokenizer locally"),
    "worker": ("services.worker.server", cfg.WORKER_SECTIONS, "serve the model (kvgrid.v1.Worker)"),
    "worker-rank": (
        "services.worker.parallel.node",
        cfg.WORKER_RANK_SECTIONS,
        "run one node's ranks of a worker group whose rank 0 runs elsewhere (--node-rank, --distributed-init-method)",
    ),
    "scheduler": ("services.scheduler.server", cfg.SCHEDULER_SECTIONS, "serve the scheduler (kvgrid.v1.Scheduler)"),
    "tokenizer": (
        "services.tokenizer.server",
        cfg.TOKENIZER_SECTIONS,
        "serve the public API (kvgrid.v1.TextGeneration)",
    ),
}
# subcommands that parse their own arguments: module with `main(argv) -> int`
CLIENTS = {
    "generate": ("kvgrid.cli.generate", "stream a completion to stdout"),
    "chat": ("kvgrid.cli.chat", "chat in the terminal"),
    "bench": ("kvgrid.cli.bench", "serving benchmark against a running stack"),
    "run-batch": ("kvgrid.offline.run_batch", "run an OpenAI batch file (JSONL) offline, in this process"),
}


def _load(module: str, command: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            sys.exit(f"kvgrid {command}: not available yet in this version")
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgrid", description="kvgrid: paged-KV LLM serving in three services")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, sections, text) in SERVICES.items():
        cfg.add_arguments(sub.add_parser(name, help=text, description=text), sections)
    for name, (_, text) in CLIENTS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in CLIENTS:
        module, _ = CLIENTS[argv[0]]
        return _load(module, argv[0]).main(argv[1:])
    args = build_parser().parse_args(argv)
    module, sections, _ = SERVICES[args.command]
    try:
        config = cfg.build_config(sections, args)
    except cfg.ConfigError as e:
        for line in str(e).splitlines():
            print(f"kvgrid {args.command}: {line}", file=sys.stderr)
        return 2
    if config.observability is not None and config.observability.log_format == "json":
        disable_progress_bars()
    return _load(module, args.command).main(config) or 0


if __name__ == "__main__":
    sys.exit(main())
