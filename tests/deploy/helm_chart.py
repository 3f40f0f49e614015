"""The chart rendered for the Helm tests: variants, renders and the helpers that read them."""

from __future__ import annotations

import dataclasses
import secrets

import kubernetes_validate
import kubernetes_validate.utils
import yaml

from services.common import config as cfg
from tests.deploy import compose

CHART = compose.ROOT / "helm" / "kvgrid"
KUBE_VERSION = "1.30.0"
# the oldest the chart supports (Chart.yaml kubeVersion: gRPC probes are GA there) and the newest schemas shipped
SCHEMA_VERSIONS = ("1.27.0", KUBE_VERSION, kubernetes_validate.utils.latest_version())
NAMESPACE = "llm"
RELEASE = "demo"
NETWORK_FIELDS = {f.name for f in dataclasses.fields(cfg.NetworkConfig)}
# set by the chart from auth and tls (files mounted from Secrets), never through the ConfigMap
SECURITY_FIELDS = {f.name for f in dataclasses.fields(cfg.SecurityConfig)}
CONFIG_VARIABLES = {cfg.env_name(f.name) for s in cfg.ALL_SECTIONS for f in dataclasses.fields(s)}


def _values(name: str) -> dict:
    return yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text())


VARIANTS = {
    "default": {},
    "cpu": _values("cpu"),
    "gpu": _values("gpu"),
    "autoscaling": _values("autoscaling"),
    # existing Secrets, cert-manager, client certificates, NetworkPolicies with restricted callers
    "security": _values("security"),
}
# one worker group over two pods (two pipeline stages of two tensor-parallel ranks): StatefulSets, a LeaderWorkerSet
GROUP_CONFIG = {"KVGRID_TENSOR_PARALLEL_SIZE": "2", "KVGRID_PIPELINE_PARALLEL_SIZE": "2"}
VARIANTS["nodes"] = {"groups": 2, "config": GROUP_CONFIG, "workerGroup": {"nodes": 2, "leaderWorkerSet": "false"}}
VARIANTS["lws"] = {"groups": 2, "config": GROUP_CONFIG, "workerGroup": {"nodes": 2, "leaderWorkerSet": "true"}}
# API keys in values (made per run, never committed) and the certificates' Secrets by their default names
API_KEYS = [secrets.token_urlsafe(24) for _ in range(2)]
VARIANTS["keys"] = {"auth": {"apiKeys": API_KEYS}, "tls": {"public": {"enabled": True}, "internal": {"enabled": True}}}
# the command of the exec probes that dial through TLS
HEALTHCHECK = ["python", "-m", "kvgrid.cli.healthcheck"]
# CRDs, which kubernetes-validate has no schema for: each is checked by its own test
CRDS = {
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "Certificate": "cert-manager.io/v1",
    "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1",
}


def _render(chart, values: dict) -> tuple[list[dict], str]:
    rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = [
        doc
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    return objects, rendered[f"{CHART.name}/templates/NOTES.txt"]


def _kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _one(objects: list[dict], kind: str, component: str) -> dict:
    found = [o for o in _kind(objects, kind) if o["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    assert len(found) == 1, f"expected one {kind} for {component}, got {len(found)}"
    return found[0]


def _workloads(objects: list[dict]) -> list[dict]:
    """Deployments and StatefulSets, and a LeaderWorkerSet as two workloads: its leader's pods and its workers'."""
    found = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    for lws in _kind(objects, "LeaderWorkerSet"):
        group = lws["spec"]["leaderWorkerTemplate"]
        for role in ("leader", "worker"):
            metadata = {**lws["metadata"], "name": f"{lws['metadata']['name']}-{role}s"}
            found.append(
                {"kind": "LeaderWorkerSet", "metadata": metadata, "spec": {"template": group[f"{role}Template"]}}
            )
    return found


def _runs_worker_rank(workload: dict) -> bool:
    """A pod of a worker group's other nodes: kvgrid worker-rank serves nothing, so it has neither ports to probe
    nor Services; it ends (and is restarted) when its group breaks."""
    return workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "worker-rank"


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
