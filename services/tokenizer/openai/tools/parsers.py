"""The tool-call parsers by name (``--tool-call-parser``)."""

from __future__ import annotations

from services.tokenizer.openai.tools.hermes import HermesParser
from services.tokenizer.openai.tools.llama3_json import Llama3JsonParser
from services.tokenizer.openai.tools.mistral import MistralParser
from services.tokenizer.openai.tools.parser import ToolParser
from services.tokenizer.openai.tools.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}
