"""Text and chat messages to prompt token ids, long inputs off the event loop: for every entry point."""

from __future__ import annotations

import asyncio

from services.common.errors import InvalidArgument
from services.tokenizer.text_tokenizer import TextTokenizer

LONG_INPUT_CHARS = 8192


async def off_loop(fn, value, num_chars: int, **kwargs):
    """Tokenize long inputs in a thread so that one big prompt does not stall every other stream."""
    if num_chars < LONG_INPUT_CHARS:
        return fn(value, **kwargs)
    return await asyncio.to_thread(fn, value, **kwargs)


async def encode_text(tokenizer: TextTokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return await off_loop(tokenizer.encode, text, len(text), add_special_tokens=add_special_tokens)


async def encode_chat(tokenizer: TextTokenizer, messages: list[dict[str, str]], field: str = "messages") -> list[int]:
    """``messages`` as {"role", "content"} dicts, rendered with the model's chat template and generation prompt."""
    if tokenizer.chat_template is None:
        raise InvalidArgument(field, "the model's tokenizer has no chat template; use Generate with a prompt")
    num_chars = sum(len(m["content"]) for m in messages)
    return await off_loop(tokenizer.encode_chat, messages, num_chars)
