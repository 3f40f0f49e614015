"""A tiny random Llama with a byte-level BPE tokenizer (any text encodes), and transformers' prompt logprobs on it."""

from __future__ import annotations

import pathlib

from tests.worker.tiny import hf_model, save_tiny_bytelevel_tokenizer, save_tiny_model

VOCAB_SIZE = 320  # the tokenizer's 263 ids, and room
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}<assistant>"


def save_bytelevel_model(path: pathlib.Path | str) -> str:
    from transformers import AutoTokenizer

    path = str(path)
    save_tiny_model(path, vocab_size=VOCAB_SIZE, max_position_embeddings=512)
    save_tiny_bytelevel_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


class PromptReference:
    """transformers' float32 log-softmax over a prompt: ``logprobs[p]`` scores token p + 1 (token 0 is unscored)."""

    def __init__(self, path: str):
        self.model = hf_model(path)

    def logprobs(self, prompt_ids: list[int]):
        import torch

        with torch.inference_mode():
            logits = self.model(torch.tensor([prompt_ids])).logits[0].float()  # [P, vocab]
        return torch.log_softmax(logits, dim=-1)[:-1]  # [P - 1, vocab]: row p scores prompt token p + 1

    def check(self, prompt_ids: list[int], entries: list, num_top: int) -> None:
        """``entries`` (PromptLogprob messages of positions 1..P-1) against transformers: logprob to 1e-4, rank,
        and the top ``num_top`` token ids."""
        ref = self.logprobs(prompt_ids)
        assert [e.token_id for e in entries] == prompt_ids[1:]
        for p, entry in enumerate(entries):
            row, token = ref[p], prompt_ids[p + 1]
            assert abs(entry.logprob - row[token].item()) < 1e-4, (p, entry.logprob, row[token].item())
            assert entry.rank == int((row > row[token]).sum()) + 1
            top_ids = row.topk(num_top).indices.tolist()
            assert [t.token_id for t in entry.top] == top_ids
            for t in entry.top:
                assert abs(t.logprob - row[t.token_id].item()) < 1e-4
