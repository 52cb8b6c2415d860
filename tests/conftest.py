"""Shared test setup: Hypothesis profiles and the path to the shared tracking model.

Profiles (select with ``DILOCO_HYPOTHESIS_PROFILE``):

* ``ci`` (default): derandomized, so every run explores the same examples and a
  failure reproduces exactly; bounded so all of tests/property runs in about a
  minute on 2 cores.
* ``long``: randomized and ~20x deeper, for a soak before a release
  (``DILOCO_HYPOTHESIS_PROFILE=long pytest tests/property``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

# tests/property/model.py is the one tracking model; tests/core uses it too.
_PROPERTY_DIR = str(Path(__file__).parent / "property")
if _PROPERTY_DIR not in sys.path:
    sys.path.insert(0, _PROPERTY_DIR)

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
