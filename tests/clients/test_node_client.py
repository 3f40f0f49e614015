"""The Node.js client package (clients/node) against a real `kvgrid serve` stack.

`npm ci` installs the pinned packages from the npm registry (skipped while node_modules matches
package-lock.json); `node --test` then runs the package's own tests and the stack tests, whose
results come back as JUnit XML so that a skipped or missing Node test fails here.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import grpc
import pytest
from google.protobuf import json_format

from kvgrid.v1 import generate_pb2, generate_pb2_grpc
from tests.e2e.stack import Stack, child_env, collect

pytestmark = pytest.mark.timeout(600)

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "clients" / "node"
STAMP = PACKAGE / "node_modules" / ".kvgrid-package-lock.sha256"
STACK_ARGS = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "512"]
MIN_NODE = (18, 17)
NODE_TIMEOUT_S = 300

# The same requests go through the Python client here and the Node client there (camelCase JSON).
GENERATE = {"prompt": "The capital of France is", "sampling": {"maxTokens": 24, "temperature": 0.0}}
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "sampling": {"maxTokens": 16}}


def node_and_npm() -> str:
    """The node binary; skips (with the reason) where node or npm is missing or too old."""
    node, npm = shutil.which("node"), shutil.which("npm")
    missing = [name for name, path in (("node", node), ("npm", npm)) if path is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not found on PATH: the Node.js client (clients/node) is not tested")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    if tuple(int(p) for p in version.lstrip("v").split(".")[:2]) < MIN_NODE:
        pytest.skip(f"node {version} is older than {'.'.join(map(str, MIN_NODE))}: the Node.js client is not tested")
    return node


@pytest.fixture(scope="module")
def node() -> str:
    """`npm ci` in clients/node unless node_modules was installed from this very package-lock.json."""
    node = node_and_npm()
    lock_hash = hashlib.sha256((PACKAGE / "package-lock.json").read_bytes()).hexdigest()
    if not STAMP.exists() or STAMP.read_text() != lock_hash:
        argv = [shutil.which("npm"), "ci", "--no-audit", "--no-fund", "--ignore-scripts"]
        proc = subprocess.run(argv, cwd=PACKAGE, capture_output=True, text=True, timeout=NODE_TIMEOUT_S)
        assert proc.returncode == 0, f"npm ci failed in {PACKAGE}:\n{proc.stdout}\n{proc.stderr}"
        STAMP.write_text(lock_hash)
    return node


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    stack = Stack(tmp_path_factory.mktemp("node") / "serve.log", STACK_ARGS).start()
    try:
        yield stack.wait_ready()
    finally:
        stack.stop()


def python_answer(method, request_json: dict, message_type) -> dict:
    """What the Python client gets for one request, in the Node client's shape."""
    text, ids, last = collect(method(json_format.ParseDict(request_json, message_type()), timeout=120))
    usage = {"promptTokens": last.usage.prompt_tokens, "completionTokens": last.usage.completion_tokens}
    assert ids, "the Python client got no tokens"
    return {"request": request_json, "text": text, "tokenIds": ids, "finishReason": last.finish_reason, "usage": usage}


def python_answers(addr: str) -> dict:
    with grpc.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30)
        return {
            "generate": python_answer(stub.Generate, GENERATE, generate_pb2.GenerateRequest),
            "chat": python_answer(stub.Chat, CHAT, generate_pb2.ChatRequest),
            "modelInfo": {"model": info.model, "vocabSize": info.vocab_size},
        }


def run_node_tests(node: str, files: list[str], xml_path: pathlib.Path, env: dict[str, str]) -> dict[str, str]:
    """Runs `node --test FILES`; returns {test name: "passed" | "failed" | "skipped"} from its JUnit report."""
    argv = [node, "--test", "--test-reporter=spec", "--test-reporter-destination=stdout"]
    argv += ["--test-reporter=junit", f"--test-reporter-destination={xml_path}", *files]
    proc = subprocess.run(argv, cwd=PACKAGE, capture_output=True, text=True, timeout=NODE_TIMEOUT_S, env=env)
    assert proc.returncode == 0, f"node --test failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    outcomes = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        failed = kinds & {"failure", "error"}
        outcomes[case.get("name")] = "failed" if failed else "skipped" if "skipped" in kinds else "passed"
    return outcomes


def test_node_package_tests_pass(node, tmp_path):
    outcomes = run_node_tests(node, ["test/client.test.mjs"], tmp_path / "unit.xml", child_env())
    assert len(outcomes) >= 10 and set(outcomes.values()) == {"passed"}, outcomes


def test_node_client_against_a_kvgrid_stack(node, stack, tmp_path):
    expected = tmp_path / "expected.json"
    expected.write_text(json.dumps(python_answers(stack.addr)))
    env = child_env() | {
        "KVGRID_TEST_ADDR": stack.addr,
        "KVGRID_TEST_SCHEDULER_ADDR": stack.scheduler_addr,
        "KVGRID_TEST_EXPECTED": str(expected),
    }
    outcomes = run_node_tests(node, ["test/stack.test.mjs"], tmp_path / "stack.xml", env)
    assert set(outcomes.values()) == {"passed"}, outcomes
    for name in (
        "a greedy Generate equals the Python client output for the same request",
        "a Chat equals the Python client output for the same conversation",
        "aborting a stream cancels the request and frees its blocks",
        "bad input is INVALID_ARGUMENT with the field named",
    ):
        assert outcomes.get(name) == "passed", (name, outcomes)


def run_example(node: str, script: str, env: dict[str, str]) -> None:
    """An example script asked the README's question: it must answer "Paris" and end with its finish line."""
    proc = subprocess.run(
        [node, f"examples/{script}", "What is the capital of France?"],
        cwd=PACKAGE,
        capture_output=True,
        text=True,
        timeout=NODE_TIMEOUT_S,
        env=child_env() | env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and re.search(r"\[(stop|length)\] \d+ tokens", proc.stdout), proc.stdout


def test_the_readme_example_runs_against_the_stack(node, stack):
    run_example(node, "generate.mjs", {"KVGRID_ADDR": stack.addr})


def test_the_openai_example_streams_a_chat_from_the_http_api(node, stack):
    """The official `openai` npm package against the frontend's OpenAI-compatible HTTP API."""
    run_example(node, "openai.mjs", {"OPENAI_BASE_URL": f"http://127.0.0.1:{stack.ports['--http-port']}/v1"})


def test_the_readme_quotes_the_example():
    example = (PACKAGE / "examples" / "generate.mjs").read_text()
    assert f"```js\n{example}```" in (ROOT / "README.md").read_text(), "README's Node.js example differs"
