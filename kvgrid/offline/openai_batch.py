"""OpenAI batch lines <-> kvgrid offline requests: the request body's fields as ``SamplingParams``, and the
result as the body ``/v1/completions`` or ``/v1/chat/completions`` would answer.

Input line: ``{"custom_id": ..., "method": "POST", "url": "/v1/completions", "body": {...}}``.
Output line: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``; a line
that cannot run has ``"response": null`` and ``"error": {"code", "message"}``.

Defaults are OpenAI's (temperature 1, completions max_tokens 16, chat up to the model's length), not
kvgrid's gRPC defaults (temperature 0). Beside OpenAI's fields a body may carry kvgrid's own sampling
fields (top_k, min_p, min_tokens, repetition_penalty, ignore_eos, stop_token_ids, include_special_tokens).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvgrid.offline.outputs import RequestOutput
from kvgrid.offline.sampling_params import SamplingParams

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OPENAI_DEFAULT_TEMPERATURE = 1.0
# Body fields taken over as they are, under the same name.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "include_special_tokens",
)
# Accepted and ignored (they do not change the result), or accepted only with the value that means "off".
IGNORED = ("model", "user", "metadata", "store", "service_tier")
OFF_VALUES = {
    "n": (None, 1),
    "best_of": (None, 1),
    "stream": (None, False),
    "echo": (None, False),
    "suffix": (None, ""),
}
COMPLETION_FIELDS = {"prompt", "max_tokens", "logprobs", "stop", *SAMPLING_FIELDS, *IGNORED, *OFF_VALUES}
CHAT_FIELDS = {
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "stop",
    "response_format",
    *SAMPLING_FIELDS,
    *IGNORED,
    "n",
    "stream",
}


class BadLine(ValueError):
    """A line that cannot run; ``custom_id`` when the line had one."""

    def __init__(self, message: str, custom_id: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.custom_id = custom_id
        self.code = code


@dataclass(slots=True)
class BatchRequest:
    custom_id: str
    url: str
    prompt: str | list[int] | None  # /v1/completions
    messages: list[dict[str, str]] | None  # /v1/chat/completions
    sampling: SamplingParams


def parse_line(line: str, max_model_len: int) -> BatchRequest:
    """One input line as a request; raises BadLine naming the problem."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadLine(f"not valid JSON: {e}") from None
    if not isinstance(item, dict):
        raise BadLine("a line must be a JSON object with custom_id, method, url and body")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine("custom_id: must be a non-empty string", None)
    if item.get("method", "POST") != "POST":
        raise BadLine(f"method: only POST is supported, got {item.get('method')!r}", custom_id)
    url, body = item.get("url"), item.get("body")
    if url not in (COMPLETIONS, CHAT):
        raise BadLine(f"url: must be {COMPLETIONS} or {CHAT}, got {url!r}", custom_id, "unsupported_url")
    if not isinstance(body, dict):
        raise BadLine("body: must be a JSON object", custom_id)
    try:
        if url == COMPLETIONS:
            return BatchRequest(custom_id, url, _prompt(body), None, completion_sampling(body))
        return BatchRequest(custom_id, url, None, _messages(body), chat_sampling(body, max_model_len))
    except (ValueError, TypeError) as e:
        raise BadLine(str(e), custom_id) from None


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not supported (supported: {', '.join(sorted(allowed))})")
    for name, off in OFF_VALUES.items():
        if name in body and body[name] not in off:
            raise ValueError(f"{name}: only {off[1]!r} is supported in batch files, got {body[name]!r}")


def _sampling(body: dict, **values: Any) -> SamplingParams:
    values.setdefault("temperature", OPENAI_DEFAULT_TEMPERATURE)
    values.update({k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None})
    stop = body.get("stop")
    if stop is not None:
        values["stop"] = [stop] if isinstance(stop, str) else stop
    return SamplingParams(**values)


def completion_sampling(body: dict) -> SamplingParams:
    _check_fields(body, COMPLETION_FIELDS)
    values: dict[str, Any] = {"max_tokens": body.get("max_tokens") or 16}
    if body.get("logprobs") is not None:
        values["logprobs"] = body["logprobs"]
    return _sampling(body, **values)


def chat_sampling(body: dict, max_model_len: int) -> SamplingParams:
    _check_fields(body, CHAT_FIELDS)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ValueError(f'response_format: only {{"type": "text"}} is supported, got {fmt!r}')
    # Without a limit a chat answer may run to the model's length (the prompt's share is taken off later).
    values: dict[str, Any] = {
        "max_tokens": body.get("max_completion_tokens") or body.get("max_tokens") or max_model_len
    }
    if body.get("logprobs"):
        values["logprobs"] = body.get("top_logprobs") or 1
    return _sampling(body, **values)


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1:
        return _prompt({"prompt": prompt[0]})
    raise ValueError("prompt: a string or a list of token ids (one prompt per line)")


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ValueError("messages: must be a list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]: must be an object with role and content")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: must be a string or a list of text parts")
        out.append({"role": m.get("role", ""), "content": content})
    return out


def response_body(request: BatchRequest, result: RequestOutput, model: str) -> dict:
    usage = {
        "prompt_tokens": result.num_prompt_tokens,
        "completion_tokens": result.num_completion_tokens,
        "total_tokens": result.num_prompt_tokens + result.num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.num_cached_tokens},
    }
    if request.url == COMPLETIONS:
        choice = {"index": 0, "text": result.text, "logprobs": _completion_logprobs(result)}
        kind, prefix = "text_completion", "cmpl"
    else:
        message = {"role": "assistant", "content": result.text}
        choice = {"index": 0, "message": message, "logprobs": _chat_logprobs(result)}
        kind, prefix = "chat.completion", "chatcmpl"
    choice["finish_reason"] = result.finish_reason
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def _completion_logprobs(result: RequestOutput) -> dict | None:
    if result.logprobs is None:
        return None
    offsets, at = [], 0
    for lp in result.logprobs:
        offsets.append(at)
        at += len(lp.token)
    return {
        "tokens": [lp.token for lp in result.logprobs],
        "token_logprobs": [lp.logprob for lp in result.logprobs],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in result.logprobs],
        "text_offset": offsets,
    }


def _chat_logprobs(result: RequestOutput) -> dict | None:
    if result.logprobs is None:
        return None

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = [
        {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t.token, t.logprob) for t in lp.top]}
        for lp in result.logprobs
    ]
    return {"content": content}


def output_line(custom_id: str | None, request_id: str | None = None, body: dict | None = None, error=None) -> str:
    """One output line: a response (status 200) or, for a line that could not run, the error."""
    response = None if body is None else {"status_code": 200, "request_id": request_id, "body": body}
    if error is not None:
        error = {"code": error.code if isinstance(error, BadLine) else "invalid_request", "message": str(error)}
    line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}
    return json.dumps(line, ensure_ascii=False)
