"""The int4 wire dtype (SPEC.md section 11, "Wire dtypes"): two elements per byte, an fp32 scale per 64.

Round trips within half a quantization step, a fixed packing layout, precise
refusals of bad encodings, the hub only, and error feedback on by default.
"""

from __future__ import annotations

import pytest
import torch

from diloco.coordinator import CoordinatorConfig
from diloco.core import ConfigError, FSMConfig
from diloco.wire import compression as c


@pytest.mark.parametrize("shape", [(0,), (1,), (5,), (64,), (65,), (3, 43), (2, 2, 129)])
def test_a_round_trip_is_within_half_a_step_of_each_block(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    enc = c.encode({"t": x}, "int4")
    n = x.numel()
    assert enc.values["t"].dtype == torch.uint8 and tuple(enc.values["t"].shape) == ((n + 1) // 2,)
    assert tuple(enc.scales["t"].shape) == (c.scale_count(n, "int4"),) == (-(-n // 64),)
    back = c.decode(enc.values, enc.scales, "int4", [("t", shape)], "test")["t"]
    assert back.shape == x.shape and back.dtype == torch.float32
    if n:
        flat = torch.nn.functional.pad(x.reshape(-1), (0, (-n) % 64)).view(-1, 64)
        half_step = (flat.abs().amax(dim=1) / 7 / 2).repeat_interleave(64)[:n]
        assert bool(((back.reshape(-1) - x.reshape(-1)).abs() <= half_step * (1 + 1e-6)).all())
    # Four bits and a half per element, against eight and an eighth for int8.
    assert enc.nbytes <= n * 0.5 + 4 * (-(-n // 64)) + 1


def test_the_packing_is_q_plus_8_the_even_element_in_the_low_nibble():
    x = torch.tensor([7.0, -7.0, 0.0, 1.0, -3.0])  # scale 1: q == x
    enc = c.encode({"t": x}, "int4")
    assert enc.scales["t"].tolist() == [1.0]
    assert enc.values["t"].tolist() == [15 | (1 << 4), 8 | (9 << 4), 5 | (8 << 4)]  # odd count: padding 8


def test_bad_int4_encodings_are_refused_precisely():
    x = torch.tensor([1.0, 2.0, 3.0])
    enc = c.encode({"t": x}, "int4")
    spec = [("t", (3,))]

    def refused(values, scales, words, kind=c.EncodingError):
        with pytest.raises(kind, match=words):
            c.decode({"t": values}, {"t": scales}, "int4", spec, "fragment 0 submission")

    v, s = enc.values["t"], enc.scales["t"]
    refused(torch.tensor([0 | (9 << 4), 8 | (8 << 4)], dtype=torch.uint8), s, "holds -8")
    refused(torch.tensor([v[0], 9 | (9 << 4)], dtype=torch.uint8), s, "padding and must be 8")
    refused(v[:1], s, r"shape \[1\].*\[2\] bytes in int4", c.EncodedMismatch)
    refused(v, torch.ones(2), "expected float32 of shape \\[1\\]")
    refused(v.to(torch.int8), s, "must be uint8")
    refused(v, torch.tensor([float("inf")]), "scales must be finite")


def test_int4_is_the_hub_planes_and_error_feedback_is_on_for_it():
    assert "int4" in c.WIRE_DTYPES and "int4" in c.LOSSY
    CoordinatorConfig(FSMConfig(min_workers=1), wire_dtype="int4")
    with pytest.raises(ConfigError, match="collective plane"):
        CoordinatorConfig(FSMConfig(min_workers=1, data_plane="collective"), wire_dtype="int4",
                          collective_timeout_s=1.0)


def test_the_server_says_what_an_int4_run_and_a_momentum_schedule_do():
    from diloco.deploy.startup import momentum_schedule, wire_line
    from diloco.outer import OuterConfig

    line = wire_line(CoordinatorConfig(FSMConfig(min_workers=1), wire_dtype="int4"))
    assert "int4 (half a byte per parameter plus an fp32 scale per 64)" in line
    assert momentum_schedule(OuterConfig(momentum_warmup=10, momentum_decay_start=100, momentum_decay_rounds=20,
                                         momentum_final=0.4)) == " (warm-up over 10 steps, decay to 0.4 over steps 100..119)"
    assert momentum_schedule(OuterConfig()) == ""
