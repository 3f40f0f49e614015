"""helm/kvgrid with ``workerGroup.nodes: 2``: a group of 2 tensor x 2 pipeline ranks over two pods, two GPUs each.

As StatefulSets (rank 0's pods and one StatefulSet per other node index) and as a LeaderWorkerSet; each pod
template validates against the Kubernetes schemas, the other nodes' pods run ``kvgrid worker-rank`` with only
their node index and the address of their own group's rank 0, and rank 0 serves the rendezvous there.
"""

from __future__ import annotations

import helm_python as helm
import kubernetes_validate
import pytest

from tests.deploy.helm_chart import (
    GROUP_CONFIG,
    NAMESPACE,
    RELEASE,
    SCHEMA_VERSIONS,
    VARIANTS,
    _env,
    _kind,
    _one,
    _render,
)

PORT = 29500
GROUP_DNS = f"{RELEASE}-kvgrid-worker-{{group}}.{RELEASE}-kvgrid-worker.{NAMESPACE}.svc.cluster.local"


def _container(template: dict) -> dict:
    return template["spec"]["containers"][0]


def _gpus(container: dict) -> tuple[int | None, int | None]:
    resources = container["resources"]
    return resources["requests"].get("nvidia.com/gpu"), resources["limits"].get("nvidia.com/gpu")


def _check_rank0(template: dict) -> None:
    container = _container(template)
    assert container["command"] == ["kvgrid", "worker"]
    env = _env(container)
    assert env["KVGRID_NNODES"] == "2" and env["KVGRID_DISTRIBUTED_INIT_METHOD"] == f"tcp://0.0.0.0:{PORT}"
    assert {"name": "rendezvous", "containerPort": PORT, "protocol": "TCP"} in container["ports"]
    assert _gpus(container) == (2, 2)  # 4 ranks over 2 pods


def test_statefulsets_start_each_groups_second_node_from_its_rank0_address(rendered):
    objects = rendered["nodes"]
    rank0 = _one(objects, "StatefulSet", "worker")
    _check_rank0(rank0["spec"]["template"])
    node = _one(objects, "StatefulSet", "worker-rank")
    assert node["metadata"]["name"] == f"{RELEASE}-kvgrid-worker-node1"
    assert node["spec"]["replicas"] == rank0["spec"]["replicas"] == 2  # pod <i> of each: group <i>
    container = _container(node["spec"]["template"])
    # the pod's ordinal (its hostname's suffix) is its group: it dials that group's rank 0
    rendezvous = f"tcp://{GROUP_DNS.format(group='${HOSTNAME##*-}')}:{PORT}"
    command = f"exec kvgrid worker-rank --node-rank 1 --distributed-init-method {rendezvous}"
    assert container["command"] == ["sh", "-c", command]
    assert _gpus(container) == (2, 2)
    assert "startupProbe" not in container and {p["name"] for p in container["ports"]} == {"rendezvous"}
    # the schedulers still dial rank 0 (worker pod <i>), which stays under the worker's headless Service
    schedulers = [d for d in _kind(objects, "Deployment") if d["metadata"]["labels"].get("kvgrid.io/group")]
    addrs = {_env(_container(d["spec"]["template"]))["KVGRID_WORKER_ADDR"] for d in schedulers}
    assert addrs == {f"{GROUP_DNS.format(group=g)}:50053" for g in (0, 1)}


def test_a_leaderworkerset_runs_rank0_as_leader_and_the_second_node_as_worker(rendered):
    objects = rendered["lws"]
    assert not _kind(objects, "StatefulSet")
    (lws,) = _kind(objects, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["name"] == f"{RELEASE}-kvgrid-worker"  # leader pods <name>-<i>: the names schedulers dial
    assert lws["spec"]["replicas"] == 2
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    _check_rank0(group["leaderTemplate"])
    container = _container(group["workerTemplate"])
    assert container["command"] == [
        "kvgrid",
        "worker-rank",
        "--node-rank",
        "$(LWS_WORKER_INDEX)",
        "--distributed-init-method",
        f"tcp://$(LWS_LEADER_ADDRESS):{PORT}",
    ]
    assert _gpus(container) == (2, 2)
    service = next(s for s in _kind(objects, "Service") if s["metadata"]["name"] == lws["metadata"]["name"])
    assert service["spec"]["clusterIP"] == "None"
    leader_labels = group["leaderTemplate"]["metadata"]["labels"]
    assert all(leader_labels.get(k) == v for k, v in service["spec"]["selector"].items())


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_the_leaderworkerset_pod_templates_validate_as_pods(rendered, version):
    (lws,) = _kind(rendered["lws"], "LeaderWorkerSet")
    for role in ("leaderTemplate", "workerTemplate"):
        template = lws["spec"]["leaderWorkerTemplate"][role]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p", **template["metadata"]},
            "spec": template["spec"],
        }
        kubernetes_validate.validate(pod, version, strict=True)


def test_group_pods_reach_each_other_under_network_policies(chart):
    values = {**VARIANTS["nodes"], "networkPolicy": {"enabled": True}}
    objects, _ = _render(chart, values)
    policy = next(p for p in _kind(objects, "NetworkPolicy") if p["metadata"]["name"].endswith("-worker-group"))
    selector = policy["spec"]["podSelector"]
    assert selector["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["worker", "worker-rank"]}
    ]
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"] == selector
    assert policy["spec"]["egress"][0]["to"][0]["podSelector"] == selector
    for version in SCHEMA_VERSIONS:
        kubernetes_validate.validate(policy, version, strict=True)


def test_nodes_that_do_not_divide_the_ranks_are_refused(chart):
    values = {"config": {**GROUP_CONFIG, "KVGRID_PIPELINE_PARALLEL_SIZE": "3"}, "workerGroup": {"nodes": 4}}
    with pytest.raises(helm.HelmRenderError, match="workerGroup.nodes 4 must divide the group's 6 ranks"):
        _render(chart, values)


def test_one_node_renders_no_group_objects(rendered):
    objects = rendered["default"]
    assert not _kind(objects, "LeaderWorkerSet")
    assert [s["metadata"]["name"] for s in _kind(objects, "StatefulSet")] == [f"{RELEASE}-kvgrid-worker"]
    assert "KVGRID_NNODES" not in _env(_container(_one(objects, "StatefulSet", "worker")["spec"]["template"]))
