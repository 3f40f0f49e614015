"""Incremental detokenization and stop strings against full decodes of the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers

from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.stop_strings import StopStringMatcher
from services.tokenizer.text_tokenizer import TextTokenizer

# Latin, accented, CJK, emoji (with skin-tone modifier and ZWJ sequences), Cyrillic, Arabic, Devanagari.
ALPHABET = list("abcdefxyz ,.\n") + list("éèüñçåø") + list("你好世界中文字") + ["🎉", "😀", "👍🏽", "👩‍💻", "🚀"]
ALPHABET += list("привет") + list("مرحبا") + list("नमस्ते")


@pytest.fixture(scope="module")
def tok(smollm) -> TextTokenizer:
    return TextTokenizer.from_files(smollm.files)


def stream(tok: TextTokenizer, ids: list[int], rng: random.Random, skip_special: bool = True, prompt=()):
    """Feed ids in random chunks of 1-3; returns (deltas from push, text from flush)."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special, prompt_ids=prompt)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.push(ids[i : i + n]))
        i += n
    return deltas, detok.flush()


def test_random_multilingual_text_streams_to_its_full_decode(tok, smollm):
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text == smollm.hf.decode(ids)
        deltas, tail = stream(tok, ids, rng)
        assert "".join(deltas) + tail == text
        assert not any("\ufffd" in d for d in deltas), "a split character leaked as U+FFFD"
        assert tail == ""


def test_output_cut_mid_character_holds_bytes_then_flushes_like_full_decode(tok):
    rng = random.Random(1)
    num_cut_mid_char = 0
    for _ in range(300):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 30)))
        ids = tok.encode(text, add_special_tokens=False)
        ids = ids[: rng.randint(1, len(ids))]  # e.g. max_tokens ends generation inside an emoji
        deltas, tail = stream(tok, ids, rng)
        full = tok.decode(ids)
        assert "".join(deltas) + tail == full
        assert not any("\ufffd" in d for d in deltas)
        num_cut_mid_char += full.endswith("\ufffd")
    assert num_cut_mid_char > 10  # the case under test really happened


def test_random_token_ids_stream_to_the_full_decode(tok):
    rng = random.Random(2)
    for _ in range(300):
        ids = [rng.randrange(17, tok.vocab_size) for _ in range(rng.randint(1, 30))]
        deltas, tail = stream(tok, ids, rng)
        assert "".join(deltas) + tail == tok.decode(ids)


def test_one_token_at_a_time_each_character_appears_once_complete(tok):
    ids = tok.encode("a🎉b你c", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids]
    assert [d for d in deltas if d] == ["a", "🎉", "b", "你", "c"]
    assert deltas.count("") == len(ids) - 5  # byte tokens of a split character emit nothing


@pytest.mark.parametrize("skip_special", [True, False])
def test_special_tokens_skipped_or_kept(tok, skip_special):
    ids = tok.encode("<|im_start|>assistant\nHi 👋 there<|im_end|>\n<|endoftext|>", add_special_tokens=False)
    assert {1, 2, 0} <= set(ids)
    deltas, tail = stream(tok, ids, random.Random(3), skip_special=skip_special)
    text = "".join(deltas) + tail
    assert text == tok.decode(ids, skip_special_tokens=skip_special)
    if skip_special:
        assert text == "assistant\nHi 👋 there\n"
    else:
        assert text == "<|im_start|>assistant\nHi 👋 there<|im_end|>\n<|endoftext|>"


def test_prompt_context_does_not_appear_in_the_output(tok):
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    out = tok.encode(" Paris, 巴黎.", add_special_tokens=False)
    deltas, tail = stream(tok, out, random.Random(4), prompt=prompt)
    assert "".join(deltas) + tail == " Paris, 巴黎."


@pytest.mark.parametrize(
    "chunks, stops, emitted, stopped",
    [
        (["Hello", " wor", "ld", "!"], ["world"], ["Hello", " ", ""], True),  # split across three deltas
        (["abc", "STO", "P", "def"], ["STOP"], ["abc", "", ""], True),
        (["ab", "c", "d"], ["cx"], ["ab", "", "cd"], False),  # a false start is released
        (["xx", "yy"], ["xyz"], ["x", "xyy"], False),
        (["one END two"], ["END"], ["one "], True),  # stop inside one delta: the rest is dropped
        (["a", "b", "c"], ["bc", "abc"], ["", "", ""], True),  # earliest match wins: "abc" starts first
        (["aaa", "ab"], ["aab"], ["a", "a"], True),  # overlapping prefixes
        (["no stops here"], [], ["no stops here"], False),
    ],
)
def test_stop_strings_are_held_back_and_excluded(chunks, stops, emitted, stopped):
    matcher = StopStringMatcher(stops)
    got = []
    for chunk in chunks:
        got.append(matcher.push(chunk))
        if matcher.stopped:
            break
    assert got == emitted
    assert matcher.stopped is stopped
    tail = matcher.flush()
    if not stopped:
        assert "".join(got) + tail == "".join(chunks)


def test_stop_string_random_splits_match_a_plain_search():
    rng = random.Random(5)
    for _ in range(500):
        text = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        matcher = StopStringMatcher(stops)
        out = "".join(matcher.push(c) for c in chunks)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            assert matcher.stopped and out == text[: min(hits)]
        else:
            assert not matcher.stopped and out + matcher.flush() == text


def sentencepiece_style_tokenizer() -> TextTokenizer:
    """A tiny Llama-2-style tokenizer: '▁' for spaces, byte fallback, a decoder that strips the first space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "▁hello"]
    pieces += ["wo", "wor", "worl", "world", "▁world"]
    vocab.update({piece: len(vocab) + i for i, piece in enumerate(pieces)})
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("▁", "hello")]
    merges += [("w", "o"), ("wo", "r"), ("wor", "l"), ("worl", "d"), ("▁", "world")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    return TextTokenizer.from_files(
        {"tokenizer.json": backend.to_str().encode(), "tokenizer_config.json": json.dumps(config).encode()}
    )


def test_sentencepiece_style_byte_fallback_and_leading_space():
    tok = sentencepiece_style_tokenizer()
    text = "hello world 你 😀 world"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.token_strings(ids)[:3] == ["▁hello", "▁world", "▁"] and "<0xE4>" in tok.token_strings(ids)
    rng = random.Random(6)
    for _ in range(20):
        deltas, tail = stream(tok, ids, rng)
        assert "".join(deltas) + tail == text and not any("\ufffd" in d for d in deltas)
        # After a prompt, the first output token keeps the space it has in context (decoded alone it loses it).
        deltas, tail = stream(tok, ids[1:], rng, prompt=ids[:1])
        assert "".join(deltas) + tail == text.removeprefix("hello")
    assert tok.decode(ids[1:]) == text.removeprefix("hello ")
