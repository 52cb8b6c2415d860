"""Tests of the pure core (diloco/core): scenarios, bad input, snapshots."""
