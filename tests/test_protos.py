"""The committed stubs in kvgrid/v1 must match what the .proto files generate."""

from __future__ import annotations

import pathlib

from tools import protogen


def test_generated_stubs_are_up_to_date(tmp_path):
    fresh = protogen.generate(tmp_path)
    assert fresh, "no stubs generated"
    committed_dir = protogen.ROOT / "kvgrid" / "v1"
    stale = [p.name for p in fresh if (committed_dir / p.name).read_bytes() != p.read_bytes()]
    assert not stale, f"stale stubs {stale}: run `make protos` and commit the result"
    extra = {p.name for p in committed_dir.glob("*_pb2*.py*")} - {p.name for p in fresh}
    assert not extra, f"stubs without a .proto: {sorted(extra)}"


def test_public_message_field_names_are_the_contract():
    from kvgrid.v1 import common_pb2, generate_pb2

    fields = lambda m: [f.name for f in m.DESCRIPTOR.fields]  # noqa: E731
    assert fields(generate_pb2.GenerateRequest)[:4] == ["prompt", "prompt_token_ids", "sampling", "request_id"]
    assert fields(generate_pb2.ChatRequest)[:8] == [
        "messages", "sampling", "request_id", "tools", "tool_choice", "parallel_tool_calls", "chat_template",
        "chat_template_kwargs",
    ]  # fmt: skip
    assert fields(generate_pb2.ChatMessage)[:5] == ["role", "content", "tool_calls", "tool_call_id", "name"]
    assert fields(generate_pb2.GenerateResponse)[:4] == ["text", "token_ids", "finish_reason", "usage"]
    assert fields(common_pb2.Usage)[:2] == ["prompt_tokens", "completion_tokens"]
    assert fields(common_pb2.SamplingParams)[:14] == [
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
        "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
    ]  # fmt: skip
    assert pathlib.Path(protogen.PROTO_DIR / "kvgrid" / "v1" / "generate.proto").exists()
