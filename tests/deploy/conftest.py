"""The Helm chart, loaded once per module, and rendered with every variant."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.deploy.helm_chart import CHART, VARIANTS, _render


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def rendered(chart):
    return {name: _render(chart, values)[0] for name, values in VARIANTS.items()}
