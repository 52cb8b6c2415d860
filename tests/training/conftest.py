"""Fixtures for tests/training (the harness itself is ``training_harness.py``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diloco import testing


@pytest.fixture(autouse=True)
def no_thread_leaks():
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 10.0
    while True:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not extra, f"threads left running: {[t.name for t in extra]}"


@pytest.fixture(autouse=True)
def one_torch_thread():
    # Several worker threads share 2 cores: intra-op threads would only oversubscribe them.
    with testing.one_torch_thread():
        yield


@pytest.fixture(scope="session", autouse=True)
def torch_warmed_up():
    """Pay torch's one-time lazy initialisation (seconds, on the first optimizer step) here,
    not inside a test whose worker must heartbeat within a fraction of a second."""
    model = torch.nn.Linear(2, 1)
    for opt in (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True),
                torch.optim.AdamW(model.parameters())):
        model(torch.randn(4, 2)).sum().backward()
        opt.step()
    torch.isfinite(torch.zeros(1)).all()
