"""The images compose builds are the ones the Helm chart runs: same names, same tags, the project's version."""

from __future__ import annotations

import re
import tomllib

import helm_python as helm
import pytest
import yaml

from tests.deploy import compose

CHART = compose.ROOT / "helm" / "kvgrid"
# what runs each service in the chart (one group): kind, and the name's end before a group number
WORKLOADS = {
    "tokenizer": ("Deployment", "tokenizer"),
    "scheduler": ("Deployment", "scheduler"),
    "worker": ("StatefulSet", "worker"),
}


def _chart_images(values: dict) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="demo", namespace="llm", is_install=True)
    texts = [text for path, text in rendered.items() if path.endswith(".yaml")]
    objects = [doc for text in texts for doc in yaml.safe_load_all(text) if doc]
    images = {}
    for service, (kind, suffix) in WORKLOADS.items():
        (obj,) = [o for o in objects if o["kind"] == kind and re.search(rf"-{suffix}(-\d+)?$", o["metadata"]["name"])]
        (container,) = [c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == service]
        images[service] = container["image"]
    return images


def _compose_images(*files) -> dict[str, str]:
    merged = {}
    for path in files:
        for name, service in yaml.safe_load(path.read_text())["services"].items():
            if name in compose.KVGRID_SERVICES and "image" in service:
                merged[name] = service["image"]
    return merged


def test_the_version_is_one_across_the_project_and_the_chart():
    project = tomllib.loads((compose.ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == project


@pytest.mark.parametrize(
    "files, values",
    [
        # the GPU stack and the chart's defaults (GPU workers)
        ((compose.COMPOSE_FILE, compose.GPU_COMPOSE_FILE), {}),
        # the CPU stack and the chart's CPU example
        ((compose.COMPOSE_FILE,), yaml.safe_load((CHART / "ci" / "cpu-values.yaml").read_text())),
    ],
    ids=["gpu", "cpu"],
)
def test_the_chart_runs_the_images_compose_builds(files, values):
    assert _chart_images(values) == _compose_images(*files)
