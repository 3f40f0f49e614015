"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's tail.

The search runs over the sequence packed as 4-byte words, with ``bytes.rfind`` (C speed); a hit at an offset
that is not a word boundary is skipped.
"""

from __future__ import annotations

from array import array

from services.worker.request_state import RequestState


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[RequestState], wanted: dict[int, int]) -> dict[int, list[int]]:
        """``wanted``: id(row) -> most proposals, for the rows that speculate -> id(row) -> proposals."""
        proposals = {}
        for r in requests:
            k = wanted.get(id(r), 0)
            if k:
                proposals[id(r)] = propose_ngram(r.token_ids, k, self.min_n, self.max_n)
        return proposals


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_tokens`` tokens after the latest earlier occurrence of the last n tokens of ``token_ids``,
    for the longest n from ``max_n`` down to ``min_n`` that occurs; [] when none does."""
    length = len(token_ids)
    if num_tokens <= 0 or length < min_n + 1:
        return []
    data = array("I", token_ids).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = data[(length - n) * 4 :]
        # Matches must start at token length - n - 1 or before (strictly before the tail, a token after them).
        hi = (length - 1) * 4
        while (at := data.rfind(pattern, 0, hi)) >= 0:
            if at % 4 == 0:
                start = at // 4 + n
                return token_ids[start : start + num_tokens]
            hi = at + n * 4 - 1  # an unaligned hit: look left of it
    return []
