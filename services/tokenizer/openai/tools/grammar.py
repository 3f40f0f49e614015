"""``tool_choice`` as a constraint the structured-output machinery already applies: a Lark grammar sent in
``SamplingParams.grammar``, so the scheduler and the worker need nothing new.

``required`` and a named function: the answer is calls (one, or several when parallel calls are allowed) whose
arguments the worker holds to each function's JSON schema. ``auto``: free text, or text then such calls, so a
call the model starts always parses. ``none``: no constraint, and the output is not read for calls.
"""

from __future__ import annotations

from services.tokenizer.openai.tools.parser import ToolParser
from services.tokenizer.openai.tools.types import ToolRequest


def tool_grammar(parser: ToolParser, request: ToolRequest) -> str | None:
    """The Lark grammar for ``request``'s answer, or None when its output is free."""
    if not request.active:
        return None
    required = request.choice.mode in ("required", "function")
    return parser.grammar(request.offered(), required, request.parallel)
