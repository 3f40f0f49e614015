"""helm/kvgrid: linted and rendered by the Helm Go SDK, every manifest valid against the Kubernetes schemas,
and wired so that probes, Services and peer addresses point at ports the containers really open."""

from __future__ import annotations

import dataclasses

import helm_python as helm
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from services.common import config as cfg
from tests.deploy.helm_chart import (  # noqa: F401
    API_KEYS,
    CHART,
    CONFIG_VARIABLES,
    CRDS,
    HEALTHCHECK,
    KUBE_VERSION,
    NAMESPACE,
    NETWORK_FIELDS,
    RELEASE,
    SCHEMA_VERSIONS,
    SECURITY_FIELDS,
    VARIANTS,
    _env,
    _kind,
    _matches,
    _one,
    _render,
    _runs_worker_rank,
    _values,
    _workloads,
)


@pytest.mark.parametrize("variant", VARIANTS)
def test_chart_lints_clean(variant):
    report = helm.lint(CHART, VARIANTS[variant], strict=True, namespace=NAMESPACE, kube_version="v" + KUBE_VERSION)
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems, problems


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_manifest_validates_against_kubernetes_schemas(rendered, variant, version):
    objects = rendered[variant]
    kinds = {"ConfigMap", "Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy"}
    if VARIANTS[variant].get("workerGroup", {}).get("leaderWorkerSet") == "true":  # the workers' pods are its
        kinds = kinds - {"StatefulSet"} | {"LeaderWorkerSet"}  # (test_helm_worker_group validates its templates)
    assert kinds <= {o["kind"] for o in objects}
    for obj in objects:
        if obj["kind"] in CRDS:  # test_service_monitor_scrapes_every_service, test_cert_manager_certificates_...
            assert obj["apiVersion"] == CRDS[obj["kind"]]
            continue
        kubernetes_validate.validate(obj, version, strict=True)


def test_validation_catches_a_broken_manifest(rendered):
    worker = _one(rendered["default"], "StatefulSet", "worker")
    broken = yaml.safe_load(yaml.safe_dump(worker))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("variant", ("default", "gpu"))
def test_worker_requests_a_gpu_and_tolerates_gpu_nodes(rendered, variant):
    pod = _one(rendered[variant], "StatefulSet", "worker")["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


def test_gpu_values_pin_workers_to_gpu_nodes_and_mount_the_models(rendered):
    pod = _one(rendered["gpu"], "StatefulSet", "worker")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/models")
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["persistentVolumeClaim"]["claimName"] == "llm-models"


def test_cpu_values_request_no_gpu(rendered):
    pod = _one(rendered["cpu"], "StatefulSet", "worker")["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in resources.get("limits", {}) | resources.get("requests", {})
    assert pod["containers"][0]["image"].endswith(":cpu")


@pytest.mark.parametrize(("gpu_count", "gpus"), [(1, 4), (0, None)])
def test_a_tensor_parallel_worker_requests_one_gpu_per_rank(chart, gpu_count, gpus):
    values = {"config": {"KVGRID_TENSOR_PARALLEL_SIZE": "4"}, "worker": {"gpu": {"count": gpu_count}}}
    objects, _ = _render(chart, values)
    worker = _one(objects, "StatefulSet", "worker")["spec"]["template"]["spec"]["containers"][0]
    resources = worker["resources"]
    assert resources["requests"].get("nvidia.com/gpu") == gpus and resources["limits"].get("nvidia.com/gpu") == gpus
    configmap = _kind(objects, "ConfigMap")[0]
    assert configmap["data"]["KVGRID_TENSOR_PARALLEL_SIZE"] == "4"  # the worker's --tensor-parallel-size
    assert worker["envFrom"][0]["configMapRef"]["name"] == configmap["metadata"]["name"]


def _port_numbers(container: dict) -> tuple[set[int], set[str]]:
    ports = container.get("ports", [])
    return {p["containerPort"] for p in ports}, {p["name"] for p in ports if "name" in p}


def _probed_port(probe: dict) -> int | str | None:
    """The port a probe checks; an exec probe must be the gRPC health check of a port of the pod itself."""
    if "exec" in probe:
        command = probe["exec"]["command"]
        assert command[:3] == HEALTHCHECK and len(command) == 4, command
        host, port = command[3].rsplit(":", 1)
        assert host == "localhost"
        return int(port)
    action = probe.get("grpc") or probe.get("tcpSocket") or probe.get("httpGet")
    return action and action["port"]


def _checks_health(probe: dict) -> bool:
    """gRPC health, the same through the healthcheck (ports under TLS), or the HTTP API's /health."""
    return "grpc" in probe or "exec" in probe or probe.get("httpGet", {}).get("path") == "/health"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_probe_points_at_an_exposed_port(rendered, variant):
    # a TCP check where clients must show a certificate: see test_probes_speak_tls_where_the_ports_do
    client_certificates = VARIANTS[variant].get("tls", {}).get("public", {}).get("clientAuth")
    for workload in _workloads(rendered[variant]):
        if _runs_worker_rank(workload):
            continue
        for container in workload["spec"]["template"]["spec"]["containers"]:
            numbers, names = _port_numbers(container)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container.get(kind)
                assert probe, f"{workload['metadata']['name']} has no {kind}"
                port = _probed_port(probe)
                assert port, f"{kind} of {container['name']} checks no port"
                assert port in numbers or port in names, f"{container['name']} {kind} probes {port}, not exposed"
            if not (container["name"] == "tokenizer" and client_certificates):
                assert _checks_health(container["readinessProbe"]), f"{container['name']}: readiness must check health"


def test_startup_budget_covers_model_loading(rendered):
    for workload in _workloads(rendered["default"]):
        probe = workload["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
        budget = probe["periodSeconds"] * probe["failureThreshold"]
        assert budget >= 600, f"{workload['metadata']['name']}: {budget}s to start is too short for a model load"


@pytest.mark.parametrize("variant", VARIANTS)
def test_services_target_named_ports_of_the_pods_they_select(rendered, variant):
    objects = rendered[variant]
    for service in _kind(objects, "Service"):
        pods = [
            w["spec"]["template"]
            for w in _workloads(objects)
            if _matches(service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
        ]
        assert pods, f"service {service['metadata']['name']} selects no pod"
        for pod in pods:
            names = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in names, f"{service['metadata']['name']}: no port {port['targetPort']}"


@pytest.mark.parametrize("variant", ("default", "gpu"))
def test_each_scheduler_dials_its_own_worker_through_the_headless_service(rendered, variant):
    objects = rendered[variant]
    sts = _one(objects, "StatefulSet", "worker")
    service = next(s for s in _kind(objects, "Service") if s["metadata"]["name"] == sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert _matches(service["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    worker_port = sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    schedulers = [d for d in _kind(objects, "Deployment") if d["metadata"]["labels"].get("kvgrid.io/group")]
    assert len(schedulers) == sts["spec"]["replicas"] == VARIANTS[variant].get("groups", 1)
    addrs = set()
    for deployment in schedulers:
        assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
        group = deployment["metadata"]["labels"]["kvgrid.io/group"]
        addr = _env(deployment["spec"]["template"]["spec"]["containers"][0])["KVGRID_WORKER_ADDR"]
        pod_dns = f"{sts['metadata']['name']}-{group}.{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
        assert addr == f"{pod_dns}:{worker_port}"
        addrs.add(addr)
    assert len(addrs) == len(schedulers), "two schedulers drive one worker"


@pytest.mark.parametrize("variant", VARIANTS)
def test_tokenizer_reaches_the_schedulers(rendered, variant):
    objects = rendered[variant]
    tokenizer = _one(objects, "Deployment", "tokenizer")
    host, port = _env(tokenizer["spec"]["template"]["spec"]["containers"][0])["KVGRID_SCHEDULER_ADDRS"].split(":")
    service = _one(objects, "Service", "scheduler")
    assert host == f"{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    assert service["spec"]["clusterIP"] == "None"
    for deployment in (d for d in _kind(objects, "Deployment") if d["metadata"]["labels"].get("kvgrid.io/group")):
        pod = deployment["spec"]["template"]
        assert _matches(service["spec"]["selector"], pod["metadata"]["labels"])
        assert int(port) in _port_numbers(pod["spec"]["containers"][0])[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_containers_are_configured_by_known_kvgrid_variables(rendered, variant):
    objects = rendered[variant]
    configmap = _kind(objects, "ConfigMap")[0]
    expected = {cfg.env_name(f.name) for s in cfg.ALL_SECTIONS for f in dataclasses.fields(s)}
    expected -= {cfg.env_name(n) for n in NETWORK_FIELDS | SECURITY_FIELDS}
    assert set(configmap["data"]) == expected, "the ConfigMap must carry every non-network, non-security setting"
    for workload in _workloads(objects):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            unknown = {k for k in _env(container) if k.startswith("KVGRID_")} - CONFIG_VARIABLES
            assert not unknown, f"{container['name']} sets unknown variables {unknown}"
            assert container["envFrom"][0]["configMapRef"]["name"] == configmap["metadata"]["name"]


def test_termination_grace_follows_the_shutdown_grace(chart):
    objects, _ = _render(chart, {"config": {"KVGRID_SHUTDOWN_GRACE": "90.5"}, "tokenizer": {"preStopSleepSeconds": 3}})
    for workload in _workloads(objects):
        assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 91 + 3 + 10


def test_config_values_reach_the_configmap(chart):
    objects, _ = _render(chart, {"config": {"KVGRID_MAX_NUM_SEQS": "7", "KVGRID_DTYPE": "float16"}})
    data = _kind(objects, "ConfigMap")[0]["data"]
    assert data["KVGRID_MAX_NUM_SEQS"] == "7" and data["KVGRID_DTYPE"] == "float16"


@pytest.mark.parametrize(
    "values",
    [
        {"config": {"KVGRID_DTYPE": "fp8"}},
        {"config": {"KVGRID_SHUTDOWN_GRACE": "-1"}},
        {"config": {"KVGRID_MAX_NUM_SEQ": "8"}},
        {"groups": 0},
        {"worker": {"gpu": {"count": 2}}},
        {"config": {"KVGRID_TENSOR_PARALLEL_SIZE": "0"}},
        {"tokenizer": {"ports": {"grpc": 70000}}},
    ],
)
def test_schema_rejects_bad_values(chart, values):
    with pytest.raises(helm.HelmError):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_autoscaling_hands_tokenizer_replicas_to_the_hpa(rendered):
    tokenizer = _one(rendered["autoscaling"], "Deployment", "tokenizer")
    assert "replicas" not in tokenizer["spec"]
    hpa = _one(rendered["autoscaling"], "HorizontalPodAutoscaler", "tokenizer")
    assert hpa["spec"]["scaleTargetRef"]["name"] == tokenizer["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 20)
    assert not _kind(rendered["default"], "HorizontalPodAutoscaler")
    assert "requests" in tokenizer["spec"]["template"]["spec"]["containers"][0]["resources"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_disruption_budgets_cover_every_workload(rendered, variant):
    objects = rendered[variant]
    budgets = _kind(objects, "PodDisruptionBudget")
    for workload in _workloads(objects):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert any(_matches(b["spec"]["selector"]["matchLabels"], labels) for b in budgets), workload["metadata"]
        pod = workload["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 30 + 5 + 10  # shutdown grace + preStop sleep + margin
        assert pod["securityContext"]["runAsNonRoot"] is True


def test_service_monitor_scrapes_every_service(rendered):
    monitors = _kind(rendered["gpu"], "ServiceMonitor")
    assert len(monitors) == 1 and not _kind(rendered["default"], "ServiceMonitor")
    monitor = monitors[0]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    port_names = {e["port"] for e in monitor["spec"]["endpoints"]}
    for service in _kind(rendered["gpu"], "Service"):
        assert _matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
        assert port_names & {p["name"] for p in service["spec"]["ports"]}, service["metadata"]["name"]


def test_notes_tell_how_to_call_the_service(chart):
    _, notes = _render(chart, {})
    assert f"port-forward svc/{RELEASE}-kvgrid-tokenizer 50051:50051" in notes
    assert 'kvgrid generate "' in notes and "--addr localhost:50051" in notes
    assert "kvgrid.v1.TextGeneration/Generate" in notes


def test_opt_in_redis_serves_the_kv_tier_url_of_every_group(chart):
    values = {"redis": {"enabled": True}, "config": {"KVGRID_KV_TIERS": "host,redis"}, "groups": 2}
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version="v" + KUBE_VERSION)
    assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2]
    objects, _ = _render(chart, values)
    for obj in objects:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    redis = _one(objects, "Deployment", "redis")
    service = _one(objects, "Service", "redis")
    pod = redis["spec"]["template"]
    assert _matches(service["spec"]["selector"], pod["metadata"]["labels"])
    assert service["spec"]["ports"][0]["targetPort"] in _port_numbers(pod["spec"]["containers"][0])[1]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    data = _kind(objects, "ConfigMap")[0]["data"]
    assert data["KVGRID_KV_REDIS_URL"] == f"redis://{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local:6379/0"
    assert data["KVGRID_KV_TIERS"] == "host,redis"
    # off by default; an external URL is taken as given
    assert not [o for o in _render(chart, {})[0] if o["metadata"]["name"].endswith("-redis")]
    external = {"config": {"KVGRID_KV_TIERS": "redis", "KVGRID_KV_REDIS_URL": "redis://cache:6379/1"}}
    objects, _ = _render(chart, external)
    assert _kind(objects, "ConfigMap")[0]["data"]["KVGRID_KV_REDIS_URL"] == "redis://cache:6379/1"
    assert not [o for o in objects if o["metadata"]["name"].endswith("-redis")]
    with pytest.raises(helm.HelmError):
        chart.render({"config": {"KVGRID_KV_TIERS": "disk"}}, name=RELEASE, namespace=NAMESPACE)


# --- security: API keys and certificates from Secrets, NetworkPolicies -----------------------------------------
