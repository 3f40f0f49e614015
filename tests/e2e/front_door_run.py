"""Each request of a spec through ``kvgrid.LLM`` one at a time, in a process of its own; results or errors as JSON.

    python -m tests.e2e.front_door_run < spec.json

spec: ``{"options": {LLM keyword options}, "requests": [["generate" | "chat", prompt or messages, sampling]]}``
with sampling as SamplingParams keyword arguments. Each result is the RequestOutput as a dict, or
``{"error": "<the ValueError's message>"}``.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from kvgrid import LLM, SamplingParams


def main() -> int:
    spec = json.load(sys.stdin)
    llm = LLM(**spec["options"])
    out = []
    for kind, prompt, sampling in spec["requests"]:
        run = llm.generate if kind == "generate" else llm.chat
        try:
            result = run(prompt, SamplingParams(**sampling), use_tqdm=False)[0]
        except ValueError as e:
            out.append({"error": str(e)})
            continue
        out.append(dataclasses.asdict(result))
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
