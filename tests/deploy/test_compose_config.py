"""docker-compose.yml and its GPU variant: accepted by docker-compose, and wired the way kvgrid needs."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess

import pytest
import yaml

from services.common import config as cfg
from services.scheduler.metrics import SchedulerMetrics
from services.tokenizer.metrics import TokenizerMetrics
from services.worker.metrics import WorkerMetrics
from tests.deploy import compose

NOT_INSTALLED = "docker-compose not installed: run `make test` as root or install it (apt-get install docker-compose)"
KNOWN_VARIABLES = {cfg.env_name(f.name) for section in cfg.ALL_SECTIONS for f in dataclasses.fields(section)}


def _compose_config(*files) -> str:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip(NOT_INSTALLED)
    args = [tool]
    for f in files:
        args += ["-f", str(f)]
    result = subprocess.run([*args, "config"], capture_output=True, text=True, cwd=compose.ROOT, timeout=120)
    assert result.returncode == 0, f"docker-compose rejects {[f.name for f in files]}:\n{result.stderr}"
    return result.stdout


def test_docker_compose_accepts_the_cpu_file():
    rendered = yaml.safe_load(_compose_config(compose.COMPOSE_FILE))
    worker = rendered["services"]["worker"]
    assert worker["build"]["args"]["DEVICE"] == "cpu"
    assert "deploy" not in worker, "the default (CPU) stack must not reserve a GPU"


def test_docker_compose_accepts_the_gpu_variant():
    rendered = yaml.safe_load(_compose_config(compose.COMPOSE_FILE, compose.GPU_COMPOSE_FILE))
    worker = rendered["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert worker["build"]["args"]["DEVICE"] == "cuda"
    assert worker["environment"]["KVGRID_DEVICE"] == "cuda"
    # the override keeps everything else of the worker
    assert worker["healthcheck"]["test"][-1] == "localhost:50053"


def test_the_gpu_variant_reserves_one_gpu_per_tensor_parallel_rank(monkeypatch):
    monkeypatch.setenv("KVGRID_TENSOR_PARALLEL_SIZE", "2")
    rendered = yaml.safe_load(_compose_config(compose.COMPOSE_FILE, compose.GPU_COMPOSE_FILE))
    worker = rendered["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert int(device["count"]) == 2
    assert worker["environment"]["KVGRID_TENSOR_PARALLEL_SIZE"] == "2"


@pytest.mark.parametrize("name", compose.KVGRID_SERVICES)
def test_kvgrid_services_are_configured_by_known_variables(name):
    env = compose.load()["services"][name]["environment"]
    unknown = {k for k in env if k.startswith("KVGRID_")} - KNOWN_VARIABLES
    assert not unknown, f"{name} sets variables no kvgrid config field reads: {sorted(unknown)}"
    others = {k for k in env if not k.startswith(("KVGRID_", "OTEL_"))}
    assert not others, f"{name}: configure kvgrid through KVGRID_* only, found {sorted(others)}"


def test_every_service_has_a_health_check_and_starts_after_its_dependencies_without_waiting_on_one():
    """podman runs no health checks without systemd: `service_healthy` would wait forever there. The
    services retry their links instead (tests/deploy/test_compose_stack.py starts them all at once)."""
    services = compose.load()["services"]
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no health check"
        for dep, spec in (service.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert spec == {"condition": "service_started"}, f"{name} waits for {dep} with {spec}"
    assert compose.startup_order(services, compose.KVGRID_SERVICES) == ["worker", "scheduler", "tokenizer"]


def test_scheduler_and_tokenizer_reach_their_peers_by_service_name():
    services = compose.load()["services"]
    assert compose.environment(services["scheduler"])["KVGRID_WORKER_ADDR"] == "worker:50053"
    assert compose.environment(services["tokenizer"])["KVGRID_SCHEDULER_ADDR"] == "scheduler:50052"
    # the scheduler compares the worker's model name and block size with its own
    shared = ("KVGRID_MODEL", "KVGRID_BLOCK_SIZE", "KVGRID_SERVED_MODEL_NAME")
    for key in shared:
        assert all(key in services[n]["environment"] for n in compose.KVGRID_SERVICES), f"{key} is not on all three"
        values = {services[n]["environment"][key] for n in compose.KVGRID_SERVICES}
        assert len(values) == 1, f"{key} differs between services: {values}"


def test_default_model_comes_from_the_image_and_others_from_the_models_volume():
    services = compose.load()["services"]
    assert "KVGRID_MODEL" not in compose.environment(services["worker"]), "unset unless the shell sets it"
    assert compose.load(environ={"KVGRID_MODEL": "/models/m.gguf"})["services"]["worker"]["environment"][
        "KVGRID_MODEL"
    ] == ("/models/m.gguf")
    assert any(str(v).endswith(":/models:ro") for v in services["worker"]["volumes"])


def test_prometheus_scrapes_the_metrics_port_of_each_service():
    services = compose.load()["services"]
    config = yaml.safe_load((compose.ROOT / "docker/prometheus/prometheus.yml").read_text())
    jobs = config["scrape_configs"]
    targets = {t for job in jobs for sc in job.get("static_configs", ()) for t in sc["targets"]}
    # the second group's services exist only under their profile: scraped through DNS discovery
    targets |= {f"{n}:{sd['port']}" for job in jobs for sd in job.get("dns_sd_configs", ()) for n in sd["names"]}
    metrics_var = {"tokenizer": "KVGRID_HTTP_PORT", "scheduler": "KVGRID_SCHEDULER_METRICS_PORT"}
    for name in [*compose.KVGRID_SERVICES, "scheduler2", "worker2"]:
        var = metrics_var.get(name.rstrip("2"), "KVGRID_WORKER_METRICS_PORT")
        port = compose.environment(services[name])[var]
        assert f"{name}:{port}" in targets
    mounted = [v for v in services["prometheus"]["volumes"] if v.startswith("./docker/prometheus/prometheus.yml:")]
    assert mounted, "prometheus does not mount docker/prometheus/prometheus.yml"


def _exported_families() -> set[str]:
    """Metric family names of the three services (counters without their _total suffix)."""
    families = set()
    for kind in (TokenizerMetrics, SchedulerMetrics, WorkerMetrics):
        families |= {family.name for family in kind("m").registry.collect()}
    return families


def test_grafana_dashboard_charts_every_exported_metric_and_nothing_else():
    dashboard = json.loads((compose.ROOT / "docker/grafana/dashboards/kvgrid.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {name for e in exprs for name in re.findall(r"\bkvgrid_[a-z0-9_]+", e)}
    families = _exported_families()
    suffixes = ("", "_total", "_bucket", "_sum", "_count")
    unknown = {n for n in used if not any(n == f + s for f in families for s in suffixes)}
    assert not unknown, f"dashboard queries metrics no service exports: {sorted(unknown)}"
    uncharted = {f for f in families if not any(n == f + s for n in used for s in suffixes)}
    assert not uncharted, f"exported metrics without a dashboard panel: {sorted(uncharted)}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_grafana_is_provisioned_with_the_dashboard_and_prometheus():
    services = compose.load()["services"]
    volumes = services["grafana"]["volumes"]
    assert "./docker/grafana/provisioning:/etc/grafana/provisioning:ro" in volumes
    dash_dir = next(v.split(":")[1] for v in volumes if v.startswith("./docker/grafana/dashboards:"))
    provider = yaml.safe_load((compose.ROOT / "docker/grafana/provisioning/dashboards/kvgrid.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == dash_dir
    source = yaml.safe_load((compose.ROOT / "docker/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"


def test_a_second_group_comes_with_the_two_groups_profile_and_the_tokenizer_routes_over_both():
    services = compose.load(environ={"KVGRID_SCHEDULER_ADDRS": "scheduler:50052,scheduler2:50052"})["services"]
    assert services["worker2"]["profiles"] == services["scheduler2"]["profiles"] == ["two-groups"]
    assert compose.environment(services["scheduler2"])["KVGRID_WORKER_ADDR"] == "worker2:50053"
    assert services["scheduler2"]["depends_on"] == {"worker2": {"condition": "service_started"}}
    assert services["worker2"]["image"] == services["worker"]["image"]
    addrs = compose.environment(services["tokenizer"])["KVGRID_SCHEDULER_ADDRS"]
    assert cfg.NetworkConfig(scheduler_addrs=addrs).scheduler_addr_list() == ["scheduler:50052", "scheduler2:50052"]
    assert "KVGRID_SCHEDULER_ADDRS" not in compose.environment(compose.load()["services"]["tokenizer"])


@pytest.mark.parametrize("path", [compose.COMPOSE_FILE, compose.GPU_COMPOSE_FILE], ids=lambda p: p.name)
def test_no_variable_has_an_empty_default(path):
    """podman-compose 1.0 leaves `${VAR:-}` in place, literally: a variable without a default is listed
    without a value instead (passed on only when the shell sets it)."""
    empty = re.findall(r"\$\{\w+:?-\}", path.read_text())
    assert not empty, f"{path.name}: {empty}"


def test_optional_services_are_behind_profiles():
    """`up` starts the three kvgrid services only: the others need images from a registry."""
    services = compose.load()["services"]
    for name, service in services.items():
        if name in compose.KVGRID_SERVICES:
            assert "profiles" not in service and "build" in service, name
        else:
            assert service.get("profiles"), f"{name} is not behind a profile"
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]


def test_only_the_frontend_publishes_ports_and_the_scheduler_and_worker_are_internal():
    doc = compose.load()
    services = doc["services"]
    assert doc["networks"]["internal"] == {"internal": True}
    for name in ("worker", "scheduler", "worker2", "scheduler2", "redis"):
        assert services[name]["networks"] == ["internal"] and "ports" not in services[name], name
    assert sorted(services["tokenizer"]["networks"]) == ["internal", "public"]
    assert "internal" in services["prometheus"]["networks"], "prometheus scrapes the internal services"
    raw = yaml.safe_load(compose.COMPOSE_FILE.read_text())["services"]
    published = {name: service["ports"] for name, service in raw.items() if "ports" in service}
    assert set(published) == {"tokenizer", "prometheus", "grafana"}
    for name, ports in published.items():
        for spec in ports:
            assert re.fullmatch(r"\$\{\w+:-(\d+)\}:(\d+)", spec), f"{name}: {spec} is not ${{VAR:-N}}:N"
            host, container = re.fullmatch(r"\$\{\w+:-(\d+)\}:(\d+)", spec).groups()
            assert host == container, f"{name}: {spec} moves the port by default"
    environ = {"KVGRID_HTTP_PORT": "18000", "KVGRID_TOKENIZER_PORT": "15051"}
    assert compose.load(environ=environ)["services"]["tokenizer"]["ports"] == ["15051:50051", "18000:8000"]
