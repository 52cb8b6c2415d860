"""Shared test setup: Hypothesis profiles.

Profiles (select with ``DILOCO_HYPOTHESIS_PROFILE``):

* ``ci`` (default): derandomized, so every run explores the same examples and a
  failure reproduces exactly; bounded so all of tests/property runs in about a
  minute on 2 cores.
* ``long``: randomized and ~20x deeper, for a soak before a release
  (``DILOCO_HYPOTHESIS_PROFILE=long pytest tests/property``).
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
settings.load_profile(os.environ.get("DILOCO_HYPOTHESIS_PROFILE", "ci"))
