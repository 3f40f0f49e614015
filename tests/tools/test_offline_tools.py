"""The offline ``LLM.chat`` with tools (the default model, float32): a named call validates against its schema,
and a bad tool_choice is a ValueError naming it."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.tools.schemas import TOOLS

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def llm():
    from kvgrid import LLM

    return LLM(dtype="float32", max_model_len=1024, kv_cache_memory="128MiB")


def test_named_call_validates(llm):
    from kvgrid import SamplingParams

    weather, add = TOOLS[0], TOOLS[1]
    (out,) = llm.chat(
        [{"role": "user", "content": "Add 2 and 3."}],
        SamplingParams(max_tokens=60, temperature=0),
        use_tqdm=False,
        tools=[weather, add],
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    assert out.tool_calls and out.text == ""
    for call in out.tool_calls:
        assert call["id"].startswith("call_") and call["function"]["name"] == "add"
        jsonschema.validate(json.loads(call["function"]["arguments"]), add["function"]["parameters"])
    plain = llm.chat([{"role": "user", "content": "Hi."}], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert plain.tool_calls is None


def test_bad_tool_choice(llm):
    with pytest.raises(ValueError, match="tool_choice"):
        llm.chat([{"role": "user", "content": "Hi."}], tools=[TOOLS[0]], tool_choice="sometimes", use_tqdm=False)
    with pytest.raises(ValueError, match="not among the tools"):
        llm.chat(
            [{"role": "user", "content": "Hi."}],
            tools=[TOOLS[0]],
            tool_choice={"type": "function", "function": {"name": "nope"}},
            use_tqdm=False,
        )


def test_a_chat_template_of_its_own(llm):
    """As vLLM's ``LLM.chat(chat_template=..., chat_template_kwargs=...)``: the prompt is what that template renders."""
    from kvgrid import SamplingParams

    qa = "{% if preamble %}{{ preamble }}\n{% endif %}Q: {{ messages[-1].content }}\nA:"
    (out,) = llm.chat(
        [{"role": "user", "content": "Hi."}],
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        chat_template=qa,
        chat_template_kwargs={"preamble": "Be brief."},
    )
    assert out.prompt_token_ids == llm.tokenizer.encode("Be brief.\nQ: Hi.\nA:", add_special_tokens=False)
