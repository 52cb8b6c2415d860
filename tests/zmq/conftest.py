"""Fixtures for tests/zmq: ``cluster`` starts real processes and always kills them (see procs.py)."""

from __future__ import annotations

import pytest

from procs import Cluster


@pytest.fixture
def cluster(tmp_path, request):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            print(c.dump())


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
