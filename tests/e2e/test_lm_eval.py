"""lm-evaluation-harness (`lm-eval` from PyPI) end to end: a multiple-choice task (loglikelihood: `echo` with
`logprobs` on /v1/completions) and a `generate_until` task, both defined here over local JSONL files, run with
`--model local-completions` against a real `kvgrid serve` and with `--model hf` on the same float32 model. The
scores are identical, and so is every sample: the loglikelihood of each choice to 1e-4, each generated text."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import urllib.request

import pytest

from tests.e2e.stack import child_env, running_stack
from tests.e2e.tiny_bytelevel import save_bytelevel_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ARGS = ["--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-model-len", "512"]
SUBJECTS = ["the truth", "no one", "a true word", "the road", "our sky", "their tree"]
CHOICES = ["is true.", "is not true.", "knows no words.", "runs on."]
MC_TASK = """\
task: kvgrid_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """\
task: kvgrid_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def write_tasks(directory: pathlib.Path) -> None:
    mc = [
        {"question": f"Q: is it so that {s}?\nA: {s}", "choices": CHOICES, "answer": i % len(CHOICES)}
        for i, s in enumerate(SUBJECTS * 2)
    ]
    gen = [{"question": f"Say what {s} is:", "answer": " true"} for s in SUBJECTS]
    for name, rows, task in [("mc", mc, MC_TASK), ("gen", gen, GEN_TASK)]:
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (directory / f"{name}.yaml").write_text(task.format(data=data))


def lm_eval(tmp: pathlib.Path, name: str, model: str, model_args: str) -> tuple[dict, dict[str, list[dict]]]:
    """Run the harness; returns the results and the logged samples per task."""
    out = tmp / f"out-{name}"
    env = child_env()
    env.update(HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp / "hf-home"), TOKENIZERS_PARALLELISM="false")
    argv = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args]
    argv += ["--tasks", "kvgrid_mc,kvgrid_gen", "--include_path", str(tmp / "tasks"), "--batch_size", "1"]
    argv += ["--output_path", str(out), "--log_samples", "--device", "cpu"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    (results_file,) = out.rglob("results_*.json")
    samples = {}
    for task in ("kvgrid_mc", "kvgrid_gen"):
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    return json.loads(results_file.read_text())["results"], samples


def served_model(http_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def test_lm_eval_scores_kvgrid_as_it_scores_transformers(tmp_path):
    model_dir = save_bytelevel_model(tmp_path / "model")
    (tmp_path / "tasks").mkdir()
    write_tasks(tmp_path / "tasks")
    hf_results, hf_samples = lm_eval(tmp_path, "hf", "hf", f"pretrained={model_dir},dtype=float32")
    with running_stack(tmp_path / "serve.log", ["--model", model_dir, *ARGS]) as stack:
        port = stack.ports["--http-port"]
        model_args = (
            f"model={served_model(port)},base_url=http://127.0.0.1:{port}/v1/completions,"
            f"tokenizer_backend=huggingface,tokenizer={model_dir},tokenized_requests=True,"
            "num_concurrent=2,max_retries=1,max_length=512"
        )
        kv_results, kv_samples = lm_eval(tmp_path, "kvgrid", "local-completions", model_args)

    assert kv_results["kvgrid_mc"]["acc,none"] == hf_results["kvgrid_mc"]["acc,none"]
    assert kv_results["kvgrid_gen"]["exact_match,none"] == hf_results["kvgrid_gen"]["exact_match,none"]
    assert len(kv_samples["kvgrid_mc"]) == len(SUBJECTS) * 2
    for kv, hf in zip(kv_samples["kvgrid_mc"], hf_samples["kvgrid_mc"], strict=True):
        kv_ll = [float(resp[0][0]) for resp in kv["resps"]]  # (loglikelihood, is_greedy) per choice, logged as text
        hf_ll = [float(resp[0][0]) for resp in hf["resps"]]
        assert kv_ll == pytest.approx(hf_ll, abs=1e-4), kv["doc_id"]
        assert kv["acc"] == hf["acc"]
    generated = [s["resps"][0][0] for s in kv_samples["kvgrid_gen"]]
    assert generated == [s["resps"][0][0] for s in hf_samples["kvgrid_gen"]]
    assert any(text.strip() for text in generated)  # the model said something: the comparison is not empty
