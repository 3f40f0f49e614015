"""The frontend's tokenizer (tokenizers + jinja2 only) against transformers on the same files."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgument
from services.tokenizer.text_tokenizer import TextTokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "héllo wörld — ça va? 你好，世界 🎉👩‍💻",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n\treturn x ** 2  # code\n",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Comment ça va? 😀"},
    ],
    [{"role": "user", "content": ""}],
]
# Exercises what transformers' environment adds: tojson without HTML escaping, loop controls,
# raise_exception, the special-token variables, trim_blocks/lstrip_blocks.
CUSTOM_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'tool' %}{{ raise_exception('tools are not supported') }}{% endif %}
    {% if loop.index > 5 %}{% break %}{% endif %}
    [{{ m['role'] | upper }}] {{ m | tojson }}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ eos_token }}"""


@pytest.fixture(scope="module")
def tok(smollm) -> TextTokenizer:
    return TextTokenizer.from_files(smollm.files)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_and_decode_match_transformers(tok, smollm, text, add_special_tokens):
    ids = tok.encode(text, add_special_tokens=add_special_tokens)
    assert ids == smollm.hf(text, add_special_tokens=add_special_tokens)["input_ids"]
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == smollm.hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tok, smollm, messages):
    expected = smollm.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.render_chat(messages) == expected
    assert tok.encode_chat(messages) == smollm.hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_custom_template_features_match_transformers(smollm):
    config = json.loads(smollm.files["tokenizer_config.json"])
    config["chat_template"] = CUSTOM_TEMPLATE
    files = {k: v for k, v in smollm.files.items() if k != "chat_template.jinja"}
    files["tokenizer_config.json"] = json.dumps(config).encode()
    tok = TextTokenizer.from_files(files)
    messages = [{"role": "user", "content": f"<b>{i} & 'quotes' é"} for i in range(7)]
    expected = smollm.hf.apply_chat_template(
        messages, chat_template=CUSTOM_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert tok.render_chat(messages) == expected
    assert "<b>0 & 'quotes' é" in expected and expected.startswith("<|im_start|>")
    with pytest.raises(InvalidArgument, match="tools are not supported") as err:
        tok.render_chat([{"role": "tool", "content": "x"}])
    assert err.value.field == "messages"


@pytest.mark.parametrize("add_bos, add_eos", [(True, False), (True, True), (False, False)])
def test_add_bos_and_eos_settings_are_honoured_like_transformers(smollm, tmp_path, add_bos, add_eos):
    from transformers import AutoTokenizer

    config = json.loads(smollm.files["tokenizer_config.json"])
    config.update(add_bos_token=add_bos, add_eos_token=add_eos)
    files = dict(smollm.files, **{"tokenizer_config.json": json.dumps(config).encode()})
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    tok = TextTokenizer.from_files(files)
    for add_special_tokens in (True, False):
        expected = hf("Hello there", add_special_tokens=add_special_tokens)["input_ids"]
        assert tok.encode("Hello there", add_special_tokens=add_special_tokens) == expected
    # tokenizer.json's post-processor decides (transformers 5 ignores the flags when it exists) ...
    assert tok.encode("Hello there") == [19556, 665]
    # ... and without one, the flags build it.
    spec = json.loads(files["tokenizer.json"])
    spec["post_processor"] = None
    tok = TextTokenizer.from_files(dict(files, **{"tokenizer.json": json.dumps(spec).encode()}))
    ids = tok.encode("Hello there")
    assert ids == [1] * add_bos + [19556, 665] + [2] * add_eos
    assert tok.encode("Hello there", add_special_tokens=False) == [19556, 665]


def test_no_chat_template_is_reported(smollm):
    files = {k: v for k, v in smollm.files.items() if k != "chat_template.jinja"}
    tok = TextTokenizer.from_files(files)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_token_strings_and_special_ids(tok, smollm):
    ids = tok.encode("Hello 🎉", add_special_tokens=False)
    assert tok.token_strings(ids) == smollm.hf.convert_ids_to_tokens(ids)
    assert {0, 1, 2} <= tok.special_token_ids
    assert tok.special_tokens["eos_token"] == "<|im_end|>"
    assert tok.vocab_size == 49152


def test_gguf_file_gives_the_same_tokenizer_as_transformers(smollm):
    from services.common.default_model import default_model_path
    from services.tokenizer.gguf_tokenizer import read_gguf_tokenizer

    tok = TextTokenizer.from_files(read_gguf_tokenizer(default_model_path()))
    for text in TEXTS:
        for add in (True, False):
            ids = tok.encode(text, add_special_tokens=add)
            assert ids == smollm.hf(text, add_special_tokens=add)["input_ids"]
            assert tok.decode(ids) == smollm.hf.decode(ids, skip_special_tokens=True)
    for messages in CONVERSATIONS:
        assert tok.render_chat(messages) == smollm.hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    assert tok.special_tokens == {k: smollm.hf.special_tokens_map[k] for k in tok.special_tokens}
    assert tok.special_token_ids == set(smollm.hf.all_special_ids) | set(range(17))


def test_gguf_metadata_flags_and_unsupported_kinds():
    from services.tokenizer.gguf_tokenizer import gguf_tokenizer_files

    tokens = ["<s>", "</s>", "a", "b", "ab"]
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
    }
    tok = TextTokenizer.from_files(gguf_tokenizer_files(metadata))
    assert tok.encode("abab") == [0, 4, 4]
    assert tok.decode([0, 4, 2, 1]) == "aba"
    with pytest.raises(ValueError, match="only byte-level BPE"):
        gguf_tokenizer_files(dict(metadata, **{"tokenizer.ggml.model": "llama"}))
