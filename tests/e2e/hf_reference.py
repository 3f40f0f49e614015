"""The reference: the same GGUF file run by Hugging Face `transformers` in float32, greedy."""

from __future__ import annotations

import os
import threading

from services.common.default_model import default_model_path


class HFReference:
    """Loads in a background thread (while the stack loads its own copy); every method waits for it."""

    def __init__(self, path: str | None = None):
        self.path = path or default_model_path()
        self.model = None
        self.tokenizer = None
        self._error: BaseException | None = None
        # Greedy outputs by (prompt, max_new_tokens, eos ids): several suites compare against the same prompts.
        self._greedy: dict[tuple, list[int]] = {}
        self._thread = threading.Thread(target=self._load, name="hf-reference", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        try:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            directory, name = os.path.dirname(self.path), os.path.basename(self.path)
            self.tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
            self.model = model.eval()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test that waits for it
            self._error = e

    def ready(self) -> HFReference:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"the transformers reference failed to load: {self._error!r}") from self._error
        return self

    def encode(self, text: str) -> list[int]:
        return list(self.ready().tokenizer(text).input_ids)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        out = self.ready().tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]

    def decode(self, ids: list[int]) -> str:
        return self.ready().tokenizer.decode(ids, skip_special_tokens=True)

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int]) -> list[int]:
        """transformers' greedy generate; the output ends at (and includes) the first EOS id."""
        import torch

        key = (tuple(prompt_ids), max_new_tokens, tuple(eos_ids))
        if key in self._greedy:
            return list(self._greedy[key])
        self.ready()
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos_ids,
                pad_token_id=eos_ids[0],
            )
        self._greedy[key] = out[0, len(prompt_ids) :].tolist()
        return list(self._greedy[key])

    def top_k_under_teacher_forcing(self, prompt_ids: list[int], output_ids: list[int], k: int) -> list[set[int]]:
        """For each output position, the k most likely tokens given the prompt and the outputs before it."""
        import torch

        self.ready()
        with torch.inference_mode():
            logits = self.model(torch.tensor([prompt_ids + output_ids])).logits[0]  # [seq, vocab]
        start = len(prompt_ids) - 1  # logits at position p predict token p + 1
        top = logits[start : start + len(output_ids)].topk(k, dim=-1).indices  # [num_outputs, k]
        return [set(row.tolist()) for row in top]


def strip_eos(ids: list[int], eos_ids: list[int]) -> list[int]:
    """The ids before the first EOS (generation stops there; whether the EOS id is echoed may differ)."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[:i]
    return ids
