"""Prompt logprobs in the OpenAI routes' two shapes.

- ``echo`` with ``logprobs`` on /v1/completions (OpenAI's legacy shape): the echoed prompt's tokens lead the
  choice's ``logprobs`` lists, the first with ``null`` logprob and ``null`` top logprobs (nothing precedes it).
- ``prompt_logprobs: k`` (vLLM's extra field, completions and chat): a list with ``null`` first, then per prompt
  token a dict from token id to ``{"logprob", "rank", "decoded_token"}`` holding the token itself and the k most
  likely tokens at that position.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgrid.v1 import common_pb2

# One entry of the completions logprobs lists: (token, logprob, top logprobs, text offset).
CompletionEntry = tuple[str, float | None, dict[str, float] | None, int]


def echo_entries(first_token: str, entries: Sequence[common_pb2.PromptLogprob], num_top: int) -> list[CompletionEntry]:
    """The prompt's tokens (``first_token``, then those of ``entries``) as completions logprobs entries, text
    offsets counted from 0 over the tokens' text."""
    out: list[CompletionEntry] = [(first_token, None, None, 0)]
    offset = len(first_token)
    for entry in entries:
        top = {t.token: t.logprob for t in entry.top[:num_top]}
        out.append((entry.token, entry.logprob, top, offset))
        offset += len(entry.token)
    return out


def vllm_prompt_logprobs(entries: Sequence[common_pb2.PromptLogprob], num_top: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` list for a prompt whose tokens after the first are scored by ``entries``."""
    out: list[dict | None] = [None]
    for entry in entries:
        position = {
            str(t.token_id): {"logprob": t.logprob, "rank": rank, "decoded_token": t.token}
            for rank, t in enumerate(entry.top[:num_top], 1)
        }
        position[str(entry.token_id)] = {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.token}
        out.append(position)
    return out
