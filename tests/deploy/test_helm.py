"""helm/kvgrid: linted and rendered by the Helm Go SDK, every manifest valid against the Kubernetes schemas,
and wired so that probes, Services and peer addresses point at ports the containers really open."""

from __future__ import annotations

import base64
import dataclasses
import secrets

import helm_python as helm
import kubernetes_validate
import kubernetes_validate.utils
import pytest
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
# API keys in values (made per run, never committed) and the certificates' Secrets by their default names
API_KEYS = [secrets.token_urlsafe(24) for _ in range(2)]
VARIANTS["keys"] = {"auth": {"apiKeys": API_KEYS}, "tls": {"public": {"enabled": True}, "internal": {"enabled": True}}}
# CRDs, which kubernetes-validate has no schema for: each is checked by its own test
CRDS = {"ServiceMonitor": "monitoring.coreos.com/v1", "Certificate": "cert-manager.io/v1"}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


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


@pytest.fixture(scope="module")
def rendered(chart):
    return {name: _render(chart, values)[0] for name, values in VARIANTS.items()}


def _kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _one(objects: list[dict], kind: str, component: str) -> dict:
    found = [o for o in _kind(objects, kind) if o["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    assert len(found) == 1, f"expected one {kind} for {component}, got {len(found)}"
    return found[0]


def _workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


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


HEALTHCHECK = ["python", "-m", "kvgrid.cli.healthcheck"]


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


def _container(objects: list[dict], kind: str, component: str) -> dict:
    return _one(objects, kind, component)["spec"]["template"]["spec"]["containers"][0]


def _pod(objects: list[dict], component: str) -> dict:
    return _one(objects, "StatefulSet" if component == "worker" else "Deployment", component)["spec"]["template"]


def _secret_file(pod: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) behind a file of the pod's first container; the mount must be read-only and whole
    (no subPath: kubelet then keeps the files up to date)."""
    container = pod["spec"]["containers"][0]
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    assert mount["readOnly"] is True and "subPath" not in mount, mount
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    secret = volume["secret"]
    assert secret["defaultMode"] == 0o440, "readable by the pod's fsGroup, no one else"
    name = path[len(mount["mountPath"].rstrip("/")) + 1 :]
    if "items" not in secret:
        return secret["secretName"], name
    items = {i["path"]: i["key"] for i in secret["items"]}
    assert name in items, f"{path} is not among the files of Secret {secret['secretName']}"
    return secret["secretName"], items[name]


def _security_env(container: dict) -> dict[str, str]:
    return {k: v for k, v in _env(container).items() if k in {cfg.env_name(n) for n in SECURITY_FIELDS}}


def test_api_keys_reach_the_tokenizer_only_as_a_mounted_secret(rendered, chart):
    objects = rendered["keys"]
    (secret,) = _kind(objects, "Secret")
    assert secret["type"] == "Opaque"
    assert base64.b64decode(secret["data"]["api-keys"]).decode().split() == API_KEYS
    tokenizer = _pod(objects, "tokenizer")
    env = _env(tokenizer["spec"]["containers"][0])
    assert "KVGRID_API_KEY" not in env and "KVGRID_METRICS_REQUIRE_KEY" not in env
    assert _secret_file(tokenizer, env["KVGRID_API_KEY_FILE"]) == (secret["metadata"]["name"], "api-keys")
    for component in ("scheduler", "worker"):  # the internal APIs take no key
        assert "KVGRID_API_KEY_FILE" not in _env(_pod(objects, component)["spec"]["containers"][0])
    # nowhere else: not in env, args, probes, annotations or NOTES
    _, notes = _render(chart, VARIANTS["keys"])
    elsewhere = yaml.safe_dump_all([o for o in objects if o is not secret]) + notes
    for key in API_KEYS:
        assert key not in elsewhere and base64.b64encode(key.encode()).decode() not in elsewhere
    # a changed key restarts the tokenizer pods; an unchanged one does not
    digest = tokenizer["metadata"]["annotations"]["checksum/api-keys"]
    again, _ = _render(chart, {**VARIANTS["keys"], "auth": {"apiKeys": API_KEYS[:1]}})
    assert _pod(again, "tokenizer")["metadata"]["annotations"]["checksum/api-keys"] != digest
    assert "checksum/api-keys" not in _pod(objects, "scheduler")["metadata"].get("annotations", {})


def test_an_existing_key_secret_is_mounted_not_created(rendered):
    objects = rendered["security"]
    assert not _kind(objects, "Secret")
    tokenizer = _pod(objects, "tokenizer")
    env = _env(tokenizer["spec"]["containers"][0])
    assert _secret_file(tokenizer, env["KVGRID_API_KEY_FILE"]) == ("kvgrid-api-keys", "api-keys")
    assert env["KVGRID_METRICS_REQUIRE_KEY"] == "true"
    assert "checksum/api-keys" not in tokenizer["metadata"]["annotations"]
    # nothing to mount by default: no key file, no certificate
    for component in ("tokenizer", "scheduler", "worker"):
        pod = _pod(rendered["default"], component)
        assert not _security_env(pod["spec"]["containers"][0])
        assert {v["name"] for v in pod["spec"]["volumes"]} <= {"tmp", "shm"}


@pytest.mark.parametrize("variant", ("keys", "security"))
def test_certificates_are_mounted_read_only_where_the_variables_point(rendered, variant):
    objects = rendered[variant]
    certificates = {c["spec"]["secretName"]: c for c in _kind(objects, "Certificate")}
    prefix = f"{RELEASE}-kvgrid"
    for component in ("tokenizer", "scheduler", "worker"):
        pod = _pod(objects, component)
        env = _security_env(pod["spec"]["containers"][0])
        internal = f"{prefix}-{component}-internal-tls"
        assert {k: _secret_file(pod, env[k]) for k in env if k.startswith("KVGRID_INTERNAL_TLS_")} == {
            "KVGRID_INTERNAL_TLS_CA": (internal, "ca.crt"),
            "KVGRID_INTERNAL_TLS_CERT": (internal, "tls.crt"),
            "KVGRID_INTERNAL_TLS_KEY": (internal, "tls.key"),
        }
        public = {k: _secret_file(pod, env[k]) for k in env if k.startswith("KVGRID_TLS_")}
        if component != "tokenizer":
            assert not public and "KVGRID_API_KEY_FILE" not in env
            continue
        client_ca = {"security": {"KVGRID_TLS_CA_FILE": ("kvgrid-client-ca", "ca.crt")}, "keys": {}}[variant]
        assert public == {
            "KVGRID_TLS_CERT_FILE": (f"{prefix}-tokenizer-tls", "tls.crt"),
            "KVGRID_TLS_KEY_FILE": (f"{prefix}-tokenizer-tls", "tls.key"),
            **client_ca,
        }
        if variant == "security":  # every Secret a pod mounts is one cert-manager issues, or named in values
            mounted = {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
            assert mounted - set(certificates) == {"kvgrid-api-keys", "kvgrid-client-ca"}
    assert bool(certificates) == (variant == "security")


def test_cert_manager_certificates_name_what_the_peers_dial(rendered):
    objects = rendered["security"]
    certificates = {c["metadata"]["name"]: c["spec"] for c in _kind(objects, "Certificate")}
    prefix = f"{RELEASE}-kvgrid"
    assert set(certificates) == {f"{prefix}-tokenizer-tls"} | {
        f"{prefix}-{c}-internal-tls" for c in ("tokenizer", "scheduler", "worker")
    }
    for name, spec in certificates.items():
        assert spec["secretName"] == name and spec["privateKey"]["rotationPolicy"] == "Always"
        issuer = (
            {"name": "letsencrypt", "kind": "ClusterIssuer"}
            if name.endswith("tokenizer-tls")
            else {"name": "kvgrid-ca", "kind": "Issuer", "group": "cert-manager.io"}
        )
        assert spec["issuerRef"] == issuer
    public = certificates[f"{prefix}-tokenizer-tls"]
    assert "llm.example.com" in public["dnsNames"] and "client auth" not in public["usages"]
    assert f"{prefix}-tokenizer.{NAMESPACE}.svc.cluster.local" in public["dnsNames"]
    # the frontend verifies the scheduler against the name it resolved; each scheduler, its worker's pod name
    scheduler_host = _env(_container(objects, "Deployment", "tokenizer"))["KVGRID_SCHEDULER_ADDRS"].rsplit(":", 1)[0]
    assert scheduler_host in certificates[f"{prefix}-scheduler-internal-tls"]["dnsNames"]
    scheduler = next(d for d in _kind(objects, "Deployment") if d["metadata"]["labels"].get("kvgrid.io/group"))
    worker_host = _env(scheduler["spec"]["template"]["spec"]["containers"][0])["KVGRID_WORKER_ADDR"].rsplit(":", 1)[0]
    assert "*." + worker_host.split(".", 1)[1] in certificates[f"{prefix}-worker-internal-tls"]["dnsNames"]
    for component in ("tokenizer", "scheduler", "worker"):  # clients of each other, and of their own probe
        spec = certificates[f"{prefix}-{component}-internal-tls"]
        assert {"server auth", "client auth"} <= set(spec["usages"]) and "localhost" in spec["dnsNames"]


def test_probes_speak_tls_where_the_ports_do(rendered, chart):
    """The kubelet's gRPC probe is plaintext only: under TLS the chart probes through what the port accepts."""
    for variant in ("keys", "security"):
        for kind, component in (("Deployment", "scheduler"), ("StatefulSet", "worker")):
            container = _container(rendered[variant], kind, component)
            port = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
            plain = _container(rendered["default"], kind, component)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if "grpc" not in plain[probe]:  # a TCP check works through TLS
                    assert container[probe] == plain[probe]
                    continue
                assert container[probe]["exec"]["command"] == [*HEALTHCHECK, f"localhost:{port}"]
                assert container[probe]["timeoutSeconds"] >= 5
    tokenizer = _container(rendered["keys"], "Deployment", "tokenizer")
    assert tokenizer["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    # clients must show a certificate, which the kubelet has none of: the port is open, at least
    tokenizer = _container(rendered["security"], "Deployment", "tokenizer")
    assert tokenizer["readinessProbe"]["tcpSocket"] == {"port": "grpc"}
    # internal mTLS only: the public port keeps its gRPC probe
    objects, _ = _render(chart, {"tls": {"internal": {"enabled": True}}})
    assert "grpc" in _container(objects, "Deployment", "tokenizer")["readinessProbe"]


@dataclasses.dataclass(frozen=True)
class Peer:
    """One end of a connection: a pod's labels in a namespace, or (labels None) an address outside the cluster."""

    labels: dict | None
    namespace: str = NAMESPACE


OUTSIDE = Peer(None)
STRANGER = Peer({"app": "something-else"})
PROMETHEUS = Peer({"app.kubernetes.io/name": "prometheus"}, "monitoring")
KUBE_DNS = Peer({"k8s-app": "kube-dns"}, "kube-system")


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "the chart's selectors use matchLabels only"
    return _matches(selector.get("matchLabels", {}), labels)


def _peer_matches(rule_peer: dict, peer: Peer) -> bool:
    assert "ipBlock" not in rule_peer
    if peer.labels is None:
        return False
    namespace = rule_peer.get("namespaceSelector")
    in_namespace = (
        peer.namespace == NAMESPACE
        if namespace is None
        else _selects(namespace, {"kubernetes.io/metadata.name": peer.namespace})
    )
    return in_namespace and _selects(rule_peer.get("podSelector", {}), peer.labels)


def _admits(policies: list[dict], pod: Peer, other: Peer, port: int, protocol: str, direction: str) -> bool:
    """NetworkPolicy semantics: a pod no policy of that direction selects is open; else one rule must match."""
    applying = [
        p["spec"]
        for p in policies
        if pod.labels is not None
        and pod.namespace == NAMESPACE
        and _selects(p["spec"]["podSelector"], pod.labels)
        and direction in p["spec"]["policyTypes"]
    ]
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    return not applying or any(
        (not rule.get("ports") or any(p["protocol"] == protocol and p["port"] == port for p in rule["ports"]))
        and (not rule.get(peers_key) or any(_peer_matches(peer, other) for peer in rule[peers_key]))
        for spec in applying
        for rule in spec.get(rules_key, [])
    )


def _connects(policies: list[dict], src: Peer, dst: Peer, port: int, protocol: str = "TCP") -> bool:
    leaves = _admits(policies, src, dst, port, protocol, "Egress")
    return leaves and _admits(policies, dst, src, port, protocol, "Ingress")


def _kvgrid_pods(objects: list[dict]) -> dict[str, tuple[Peer, dict[str, int]]]:
    """component -> (its pods, its named ports)"""
    return {
        w["metadata"]["labels"]["app.kubernetes.io/component"]: (
            Peer(w["spec"]["template"]["metadata"]["labels"]),
            {p["name"]: p["containerPort"] for p in w["spec"]["template"]["spec"]["containers"][0]["ports"]},
        )
        for w in _workloads(objects)
    }


@pytest.mark.parametrize("variant", ("default", "security"))
def test_network_policies_allow_exactly_the_service_graph(rendered, variant):
    objects = rendered[variant]
    policies = _kind(objects, "NetworkPolicy")
    pods = _kvgrid_pods(objects)
    for policy in policies:  # one per component, both directions, selecting exactly its pods
        component = policy["metadata"]["labels"]["app.kubernetes.io/component"]
        assert policy["spec"]["podSelector"]["matchLabels"] == _one(objects, "Service", component)["spec"]["selector"]
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert sorted(p["metadata"]["labels"]["app.kubernetes.io/component"] for p in policies) == sorted(pods)
    ingress_controller = Peer({"app.kubernetes.io/name": "ingress-nginx"}, "ingress-nginx")
    callers = {name: pod for name, (pod, _) in pods.items()} | {
        "prometheus": PROMETHEUS,
        "stranger": STRANGER,
        "outside": OUTSIDE,
        "ingress": ingress_controller,
    }
    # from anywhere by default, yet not from the scheduler or worker: they call nothing but their peers
    public = {"default": {"prometheus", "stranger", "outside", "ingress"}, "security": {"ingress"}}[variant]
    allowed = {("tokenizer", "scheduler", "grpc"), ("scheduler", "worker", "grpc")}
    allowed |= {("prometheus", c, "metrics") for c in ("scheduler", "worker")} | {("prometheus", "tokenizer", "http")}
    allowed |= {(caller, "tokenizer", port) for caller in public for port in ("grpc", "http")}
    for src, src_peer in callers.items():
        for dst, (dst_peer, ports) in pods.items():
            for name, port in ports.items():
                expected = (src, dst, name) in allowed
                assert _connects(policies, src_peer, dst_peer, port) == expected, f"{src} -> {dst}:{name} ({port})"
    for name, (pod, _) in pods.items():
        assert _connects(policies, pod, KUBE_DNS, 53, "UDP") and _connects(policies, pod, KUBE_DNS, 53, "TCP")
        assert not _connects(policies, pod, OUTSIDE, 443), f"{name} may call out"
    if variant == "security":  # the OTLP collector of `otel`, and nothing else outside
        assert all(_connects(policies, pod, OUTSIDE, 4317) for pod, _ in pods.values())


def test_redis_is_reached_by_schedulers_and_workers_only(chart):
    values = {"redis": {"enabled": True}, "config": {"KVGRID_KV_TIERS": "host,redis"}}
    objects, _ = _render(chart, values)
    for obj in objects:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    policies = _kind(objects, "NetworkPolicy")
    pods = _kvgrid_pods(objects)
    redis, ports = pods.pop("redis")
    for name, (pod, _) in pods.items():
        assert _connects(policies, pod, redis, ports["redis"]) == (name != "tokenizer"), name
    assert not _connects(policies, STRANGER, redis, ports["redis"])
    assert not _connects(policies, redis, OUTSIDE, 443) and not _connects(policies, redis, KUBE_DNS, 53, "UDP")
    # an external server: its port, on any address; none while the tier is off
    external = {"config": {"KVGRID_KV_TIERS": "redis", "KVGRID_KV_REDIS_URL": "rediss://cache.example:6380/1"}}
    for values, reaches in ((external, True), ({"redis": {"enabled": True}}, False)):
        objects, _ = _render(chart, values)
        policies = _kind(objects, "NetworkPolicy")
        scheduler, _ = _kvgrid_pods(objects)["scheduler"]
        target, port = (OUTSIDE, 6380) if reaches else (_kvgrid_pods(objects)["redis"][0], 6379)
        assert _connects(policies, scheduler, target, port) == reaches


def test_network_policies_can_be_turned_off(chart):
    objects, _ = _render(chart, {"networkPolicy": {"enabled": False}})
    assert not _kind(objects, "NetworkPolicy")


@pytest.mark.parametrize(
    "values",
    [
        {"auth": {"apiKeys": ["short"]}},
        {"auth": {"apiKeys": ["a-long-enough-key,another-one"]}},
        {"auth": {"apiKeys": ["#commented-out-in-the-file"]}},
        {"auth": {"existingSecret": "keys", "apiKeys": [API_KEYS[0]]}},
        {"auth": {"metricsRequireKey": True}},
        {"auth": {"existingSecret": "Not_A_Name"}},
        {"tls": {"public": {"enabled": "yes"}}},
        {"certManager": {"enabled": True}, "tls": {"internal": {"enabled": True}}},
        {"networkPolicy": {"prometheus": {"podSelector": None}}},
        {"networkPolicy": {"ingressFrom": [{}]}},
    ],
)
def test_security_values_are_checked(chart, values):
    with pytest.raises(helm.HelmError):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
