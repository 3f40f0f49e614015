"""The progress bar of a generate call: requests done, and input and output tokens per second."""

from __future__ import annotations

import sys
import time


class Progress:
    """A tqdm bar on stderr; off when not asked for or when stderr is not a terminal."""

    def __init__(self, total: int, enabled: bool, desc: str = "Processed prompts"):
        self._bar = None
        if enabled and total and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, file=sys.stderr)
        self._started = time.perf_counter()
        self._num_input = 0
        self._num_output = 0

    def done(self, num_prompt_tokens: int, num_completion_tokens: int) -> None:
        if self._bar is None:
            return
        self._num_input += num_prompt_tokens
        self._num_output += num_completion_tokens
        seconds = max(time.perf_counter() - self._started, 1e-9)
        self._bar.set_postfix_str(
            f"input: {self._num_input / seconds:.1f} tok/s, output: {self._num_output / seconds:.1f} tok/s",
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
