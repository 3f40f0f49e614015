"""`kvgrid run-batch` as a user runs it: a real process, an OpenAI batch file in, one result line per line out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvgrid import SamplingParams
from tests.e2e.stack import child_env
from tests.offline.conftest import TINY_OPTIONS, word_prompt

pytestmark = pytest.mark.timeout(300)

NUM_GOOD = 50


def good_line(i: int) -> dict:
    """Completions (text and token-id prompts) and chats, greedy; every fifth one sampled with a seed."""
    body: dict = {"max_tokens": 3 + i % 9, "temperature": 0, "ignore_eos": True}
    if i % 5 == 4:
        body.update(temperature=0.8, top_p=0.9, seed=i)
    if i % 2:
        body["messages"] = [{"role": "user", "content": word_prompt(i, 2 + i % 5)}]
        url = "/v1/chat/completions"
    else:
        body["prompt"] = word_prompt(i, 2 + i % 7) if i % 4 else [5 + i, 6, 7]
        url = "/v1/completions"
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


BAD_LINES = [
    (
        "bad-temperature",
        '{"custom_id": "bad-temperature", "url": "/v1/completions", "body": {"prompt": "t5", "temperature": 500}}',
        "temperature: must be in [0, 100], got 500",
        400,  # the body is at fault: the line carries what /v1/completions answers
    ),
    (None, '{"custom_id": "broken", "url": ', "not valid JSON", None),
    (
        "bad-url",
        '{"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "t5"}}',
        "url: must be one of /v1/completions, /v1/chat/completions",
        None,  # not a request this command runs: no HTTP answer
    ),
]


def run_batch(tiny_model: str, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kvgrid.cli", "run-batch", "--model", tiny_model, *args]
    argv += ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "8MiB", "--num-threads", "1"]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=240, env=child_env())


def expected_output(llm, line: dict):
    body = line["body"]
    params = SamplingParams(
        max_tokens=body["max_tokens"],
        temperature=body["temperature"],
        top_p=body.get("top_p", 1.0),
        seed=body.get("seed"),
        ignore_eos=True,
    )
    if "messages" in body:
        return llm.chat(body["messages"], params, use_tqdm=False)[0]
    return llm.generate([body["prompt"]], params, use_tqdm=False)[0]


def test_fifty_good_and_three_bad_lines(tmp_path, tiny_model, tiny_llm):
    assert TINY_OPTIONS["max_model_len"] == 128  # run_batch passes the same options as flags
    good = [good_line(i) for i in range(NUM_GOOD)]
    lines = [json.dumps(line) for line in good]
    for k, (_, text, _, _) in enumerate(BAD_LINES):
        lines.insert(10 + 15 * k, text)
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    proc = run_batch(tiny_model, ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")])
    assert proc.returncode == 0, proc.stderr
    assert "50 requests done, 3 lines failed" in proc.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(out) == len(lines)
    by_id = {o["custom_id"]: o for o in out if o["custom_id"] is not None}
    for line in good:
        result = by_id[line["custom_id"]]
        assert result["error"] is None and result["response"]["status_code"] == 200
        body = result["response"]["body"]
        expected = expected_output(tiny_llm, line)
        choice = body["choices"][0]
        text = choice["message"]["content"] if "messages" in line["body"] else choice["text"]
        assert body["object"] == ("chat.completion" if "messages" in line["body"] else "text_completion")
        assert text == expected.text, line
        assert choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == line["body"]["max_tokens"]
        assert body["usage"]["prompt_tokens"] == expected.num_prompt_tokens
    for custom_id, _, message, status in BAD_LINES:
        errors = [o for o in out if o["custom_id"] == custom_id and o["error"] is not None]
        assert len(errors) == 1
        assert message in errors[0]["error"]["message"]
        if status is None:
            assert errors[0]["response"] is None
        else:
            assert errors[0]["response"]["status_code"] == status
            assert errors[0]["response"]["body"]["error"]["message"] == errors[0]["error"]["message"]
    assert [o["custom_id"] for o in out if o["error"] is None] == [line["custom_id"] for line in good]


def test_stdin_to_stdout(tiny_model):
    lines = [json.dumps(good_line(i)) for i in (0, 1)]
    proc = run_batch(tiny_model, ["-i", "-", "-o", "-"], stdin="\n".join(lines) + "\n")
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [o["custom_id"] for o in out] == ["req-0", "req-1"]
    assert all(o["response"]["status_code"] == 200 for o in out)


def test_a_missing_input_file_is_one_line(tiny_model, tmp_path):
    proc = run_batch(tiny_model, ["-i", str(tmp_path / "nope.jsonl"), "-o", "-"])
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"kvgrid run-batch: cannot read {tmp_path / 'nope.jsonl'}: No such file or directory"
    ]
