"""Fixtures of the security tests: throwaway certificates (see ``certs``)."""

from __future__ import annotations

import pytest

from tests.security.certs import Pki, make_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))
