"""helm/kvgrid with API keys, certificates and NetworkPolicies: keys only as a mounted Secret, certificates where
the variables point, the policies' traffic graph exactly, probes that speak TLS where the ports do."""

from __future__ import annotations

import base64
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
    _values,
    _workloads,
)


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
