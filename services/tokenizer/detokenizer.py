"""Incremental detokenization: token ids in, text deltas out, never half a character.

A character can span tokens (byte-level BPE splits emoji and CJK into bytes), and
some decoders change a token's text depending on what precedes it (SentencePiece
drops a leading space at the start). So each step decodes a short window of
recent ids twice: the part already emitted (``[prefix_offset, read_offset)``) and
the whole window (``[prefix_offset, len)``); the new text is the difference.
While the window's text ends in U+FFFD, the last character is incomplete and
the delta is held back until a later token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.tokenizer.text_tokenizer import TextTokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the output so its first token gets the right leading space.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()):
        self._decode = tokenizer.decoder(skip_special_tokens)
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # the prompt ends mid-character: its tail would misalign the output's text
        self._ids = context
        # Invariant: ids[prefix_offset:read_offset] decode to text already emitted (or prompt context), and
        # read_offset sits on a character boundary.
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_context = len(context)

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    def push(self, token_ids: list[int]) -> str:
        """Append generated ids; returns the newly complete text (possibly '')."""
        if not token_ids:
            return ""  # the window is unchanged since the last call, which emitted what it could
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the request: whatever is held back, incomplete characters included (as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        emitted = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) <= len(emitted) or (window.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window[len(emitted) :]
