"""Run requests through ``kvgrid.LLM`` in a process of its own and print the results as JSON.

    python -m tests.e2e.offline_run < spec.json

spec: ``{"options": {LLM keyword options}, "generate": [[prompt, sampling], ...], "chat": [[messages, sampling],
...]}`` with sampling as SamplingParams keyword arguments. The parity tests run the offline engine here rather than
in the pytest process, which already holds the transformers reference and the gRPC channels: a user's program.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from kvgrid import LLM, SamplingParams


def main() -> int:
    spec = json.load(sys.stdin)
    llm = LLM(**spec["options"])
    out = {"eos_token_ids": list(llm.engine.core.handshake.eos_token_ids)}
    for kind in ("generate", "chat"):
        items = spec.get(kind, [])
        run = llm.generate if kind == "generate" else llm.chat
        results = run([item for item, _ in items], [SamplingParams(**s) for _, s in items], use_tqdm=False)
        out[kind] = [dataclasses.asdict(r) for r in results]
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
