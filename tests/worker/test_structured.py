"""Structured-output masks at the sampler, on random logits over a small byte-level vocabulary."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvgrid.v1 import common_pb2
from services.worker.sampling.sampler import RequestSampling, Sampler
from services.worker.sampling.structured import GrammarCache, apply_token_masks
from tests.worker.tiny import tiny_bytelevel_tokenizer

VOCAB = 300  # logits width: the tokenizer's 263 ids and padding
EOS = 262
CPU = torch.device("cpu")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        "pos": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "ok": {"type": "boolean"}},
            "required": ["x", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "pos"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_bytelevel_tokenizer()


@pytest.fixture
def grammars(tokenizer) -> GrammarCache:
    return GrammarCache(tokenizer.to_str(), VOCAB, [EOS])


def constrained(grammars: GrammarCache, outputs: list[int] | None = None, **fields) -> RequestSampling:
    params = common_pb2.SamplingParams(**fields)
    outputs = outputs or []
    return RequestSampling.create(params, [1], outputs, constraint=grammars.constraint(params, outputs))


def token_texts(tokenizer) -> dict[int, str]:
    return {i: tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.get_vocab_size())}


def masked_ids(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


def generate(sampler: Sampler, requests: list[RequestSampling], seed: int, max_steps: int = 80) -> list[list[int]]:
    """Sample every request on random logits until it samples EOS (or max_steps)."""
    gen = torch.Generator().manual_seed(seed)
    outputs: list[list[int]] = [[] for _ in requests]
    live = list(range(len(requests)))
    for _ in range(max_steps):
        if not live:
            break
        logits = torch.randn(len(live), VOCAB, generator=gen) * 3
        out = sampler(logits, [requests[i] for i in live])
        for i, token in zip(live, out.token_ids, strict=True):
            outputs[i].append(token)
            requests[i].append(token)
        live = [i for i in live if outputs[i][-1] != EOS]
    return outputs


def test_first_mask_of_a_choice_is_every_token_that_starts_a_choice(grammars, tokenizer):
    request = constrained(grammars, choice=common_pb2.Choices(choices=["true", "no"]))
    logits = torch.zeros(1, VOCAB)
    apply_token_masks(logits, [0], [request.constraint])
    texts = token_texts(tokenizer)
    expected = {i for i, text in texts.items() if text and ("true".startswith(text) or "no".startswith(text))}
    assert masked_ids(logits[0]) == expected and {"tru", "true", "no"} <= {tokenizer.id_to_token(i) for i in expected}


def test_a_complete_output_allows_only_eos(grammars, tokenizer):
    request = constrained(grammars, choice=common_pb2.Choices(choices=["true", "no"]))
    request.append(tokenizer.token_to_id("no"))
    logits = torch.zeros(1, VOCAB)
    apply_token_masks(logits, [0], [request.constraint])
    assert masked_ids(logits[0]) == {EOS}


def test_a_failed_matcher_allows_only_eos(grammars, tokenizer):
    request = constrained(grammars, regex="[0-9]+")
    request.append(tokenizer.token_to_id("a"))  # outside the mask: only a banned-out row can sample it
    logits = torch.zeros(1, VOCAB)
    apply_token_masks(logits, [0], [request.constraint])
    assert masked_ids(logits[0]) == {EOS}


def test_unconstrained_rows_are_untouched():
    tokenizer = tiny_bytelevel_tokenizer()
    grammars = GrammarCache(tokenizer.to_str(), VOCAB, [EOS])
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    request = constrained(grammars, regex="[a-c]+")
    apply_token_masks(logits, [1], [request.constraint])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert masked_ids(logits[1]) == {tokenizer.token_to_id(c) for c in "abc"}


def test_greedy_takes_the_argmax_of_the_allowed_tokens(grammars, tokenizer):
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    allowed = [tokenizer.token_to_id(c) for c in "0123456789"]
    out = Sampler(VOCAB, CPU)(
        logits.clone(),
        [constrained(grammars, regex="[0-9]{2}"), RequestSampling.create(common_pb2.SamplingParams(), [1], [])],
    )
    assert out.token_ids[0] == allowed[int(logits[0, allowed].argmax())]
    assert out.token_ids[1] == int(logits[1].argmax())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_matches_its_constraint(grammars, tokenizer, temperature):
    sampler = Sampler(VOCAB, CPU, seed=7)
    specs = [
        dict(regex=r"-?[0-9]{1,3}(\.[0-9]{1,2})?"),
        dict(choice=common_pb2.Choices(choices=["true", "no", "maybe so"])),
        dict(json_schema=json.dumps(SCHEMA)),
        dict(grammar='start: "(" item (" " item)* ")"\nitem: /[a-z]{1,4}/ | start'),
    ]
    for seed in range(4):
        requests = [constrained(grammars, temperature=temperature, seed=seed, **spec) for spec in specs]
        outputs = generate(sampler, requests, seed, max_steps=300)
        assert all(out[-1] == EOS for out in outputs), outputs
        texts = [tokenizer.decode(out[:-1]) for out in outputs]
        assert re.fullmatch(r"-?[0-9]{1,3}(\.[0-9]{1,2})?", texts[0]), texts[0]
        assert texts[1] in ("true", "no", "maybe so")
        jsonschema.validate(json.loads(texts[2]), SCHEMA)
        assert re.fullmatch(r"\((\(|\)|[a-z ])*\)", texts[3]) and texts[3].count("(") == texts[3].count(")")


def test_json_object_starts_an_object_and_closes_it(grammars, tokenizer):
    request = constrained(grammars, json_object=True)
    logits = torch.zeros(1, VOCAB)
    apply_token_masks(logits, [0], [request.constraint])
    assert masked_ids(logits[0]) == {tokenizer.token_to_id("{")}  # no leading whitespace
    for token in tokenizer.encode('{"a": [1, {"b": null}]}').ids:
        request.append(token)
    logits = torch.zeros(1, VOCAB)
    apply_token_masks(logits, [0], [request.constraint])
    assert masked_ids(logits[0]) == {EOS}


def test_a_resumed_request_samples_what_the_uninterrupted_one_did(grammars):
    """Preemption: the worker rebuilds the matcher from the outputs the NewRequest carries."""
    spec = dict(json_schema=json.dumps(SCHEMA), temperature=1.0, seed=42)
    full = generate(Sampler(VOCAB, CPU), [constrained(grammars, **spec)], seed=3, max_steps=300)[0]
    assert full[-1] == EOS and len(full) > 10
    cut = len(full) // 2
    gen = torch.Generator().manual_seed(3)
    logits = [torch.randn(1, VOCAB, generator=gen) * 3 for _ in full]
    resumed = constrained(grammars, outputs=full[:cut], **spec)
    sampler = Sampler(VOCAB, CPU)
    tail = []
    for step in range(cut, len(full)):
        token = sampler(logits[step], [resumed]).token_ids[0]
        resumed.append(token)
        tail.append(token)
    assert full[:cut] + tail == full


def test_each_distinct_spec_is_compiled_once(grammars):
    for _ in range(3):
        constrained(grammars, regex="[0-9]+")
        constrained(grammars, choice=common_pb2.Choices(choices=["a", "b"]))
    constrained(grammars, choice=common_pb2.Choices(choices=["a", "c"]))
    constrained(grammars)  # unconstrained: nothing to compile
    assert grammars.num_compiled == 3


def test_unconstrained_greedy_keeps_the_argmax_hot_path(grammars):
    assert RequestSampling.create(common_pb2.SamplingParams(), [1], []).plain_greedy
    assert not constrained(grammars, regex="a").plain_greedy
