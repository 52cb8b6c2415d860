"""Shared test setup: Hypothesis profiles.

Profiles (select with ``DILOCO_HYPOTHESIS_PROFILE``):

* ``ci`` (default): derandomized, so every run explores the same examples and a
  failure reproduces exactly; bounded so all of tests/property runs in about a
  minute on 2 cores.
* ``long``: randomized and ~20x deeper, for a soak before a release
  (``DILOCO_HYPOTHESIS_PROFILE=long pytest tests/property``).
* ``mutation``: derandomized and smaller than ``ci``, for ``mutmut run`` (pyproject.toml
  ``[tool.mutmut]`` passes ``--hypothesis-profile=mutation``): every surviving mutant runs
  the whole selection, so its size sets the run's length.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=250,
    stateful_step_count=50,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile(
    "long",
    derandomize=False,
    max_examples=1500,
    stateful_step_count=120,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile(
    "mutation",
    derandomize=True,
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.load_profile(os.environ.get("DILOCO_HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(session, config, items):
    """Under mutmut (``MUTANT_UNDER_TEST`` is set), run the fast unit tests first.

    mutmut runs each mutant's tests with ``-x`` in no particular order; the core's unit
    tests kill most mutants in well under a second, the exhaustive search takes ~40 s.
    A normal run keeps pytest's order.
    """
    if "MUTANT_UNDER_TEST" not in os.environ:
        return

    def rank(item) -> tuple[int, str]:
        nodeid = item.nodeid
        if nodeid.startswith("tests/core/"):
            return (1 if "fuzz" in nodeid else 0, nodeid)
        return (3 if "exhaustive" in nodeid else 2, nodeid)

    items.sort(key=rank)
