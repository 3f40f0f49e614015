"""The encoder budget: how much vision-encoder work one step may carry (vLLM's encoder compute budget).

An image's encoder runs in the step that computes the first of its placeholder tokens the worker has not
seen (its first chunk, or the first after a prefix hit that ends inside it); its cost is its placeholder
count. A step takes images while their cost fits the budget left; a request whose next image does not fit
is computed up to that image's first placeholder and continues in a later step. The first image of a step
always fits, so an image larger than the budget still runs, alone.
"""

from __future__ import annotations

from collections.abc import Sequence


class EncoderBudget:
    __slots__ = ("left", "used")

    def __init__(self, budget: int):
        self.left = budget
        self.used = 0

    def fit(self, spans: Sequence[tuple[int, int, str]], start: int, num_new: int, first: bool) -> int:
        """Tokens of [start, start + num_new) this step may compute, charging the images it encodes. ``first``:
        the worker gets the request anew this step, so an image begun before ``start`` is encoded too."""
        end = start + num_new
        cost = 0
        for offset, length, _ in spans:
            if offset >= end:
                break
            if offset + length <= start or (offset < start and not first):
                continue
            if cost + length > self.left and (self.used or cost):
                num_new = max(offset, start) - start
                break
            cost += length
        self.left -= cost
        self.used += cost
        return num_new
