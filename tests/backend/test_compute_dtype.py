"""The compute dtype policy: `auto` is bf16 only where the device computes it natively."""

from __future__ import annotations

import logging
import platform
import warnings

import pytest
import torch

from skyrl_trainer.backend import compute_dtype as cd
from skyrl_trainer.backend.errors import InvalidRequestError

FIELD = "backend.training.dtype"

AVX2 = cd.DeviceBf16("cpu", False, "CPU capability AVX2, no AVX512-BF16/AMX", slowdown=37.0)
AVX512_NO_BF16 = cd.DeviceBf16("cpu", False, "CPU capability AVX512, no AVX512-BF16/AMX")
AMX = cd.DeviceBf16("cpu", True, "CPU capability AVX512, AMX-BF16+AVX512-BF16")
CUDA_BF16 = cd.DeviceBf16("cuda", True, "NVIDIA H100, bf16 supported")
CUDA_OLD = cd.DeviceBf16("cuda", False, "Tesla V100, bf16 unsupported")


# ------------------------------------------------------------------------------------------------
# names


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("BF16", torch.bfloat16),
        ("torch.float32", torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_parse_dtype(name, dtype):
    assert cd.parse_dtype(name) is dtype


@pytest.mark.parametrize("name", ["int8", "float64", "", "half precision"])
def test_parse_dtype_rejects_unknown_names_with_allowed_values(name):
    with pytest.raises(InvalidRequestError) as info:
        cd.parse_dtype(name, field="model.dtype")
    assert info.value.field == "model.dtype"
    for allowed in ("auto", "bfloat16", "bf16", "float32", "fp32", "float16", "fp16"):
        assert repr(allowed) in info.value.problem


# ------------------------------------------------------------------------------------------------
# the decision, for each kind of device (no such hardware needed)


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        (AVX2, torch.float32),
        (AVX512_NO_BF16, torch.float32),
        (AMX, torch.bfloat16),
        (CUDA_BF16, torch.bfloat16),
        (CUDA_OLD, torch.float32),
    ],
)
def test_auto_is_bf16_exactly_where_it_is_native(device, expected):
    choice = cd.choose_dtype("auto", device, field=FIELD)
    assert choice.dtype is expected
    assert choice.warning is None
    # One line that says what was asked, what was chosen, on what, and why.
    assert "\n" not in choice.reason
    assert f"{FIELD}=auto" in choice.reason
    assert str(expected).removeprefix("torch.") in choice.reason
    assert device.detail in choice.reason


def test_forced_bf16_on_a_cpu_without_it_runs_with_a_warning_naming_slowdown_and_fix():
    choice = cd.choose_dtype("bfloat16", AVX2, field=FIELD)
    assert choice.dtype is torch.bfloat16  # still honoured
    assert "37x slower than float32" in choice.warning
    assert f"{FIELD}=auto" in choice.warning and "float32" in choice.warning
    # Without a measurement the warning still says what to expect.
    unmeasured = cd.choose_dtype("bf16", AVX512_NO_BF16, field=FIELD)
    assert "20-100x slower" in unmeasured.warning


@pytest.mark.parametrize("device", [AMX, CUDA_BF16])
def test_forced_bf16_where_native_has_no_warning(device):
    assert cd.choose_dtype("bfloat16", device, field=FIELD).warning is None


@pytest.mark.parametrize("device", [AVX2, AMX, CUDA_BF16])
def test_float32_is_always_float32_without_warning(device):
    choice = cd.choose_dtype("float32", device, field=FIELD)
    assert choice.dtype is torch.float32 and choice.warning is None


def test_unknown_name_names_the_field():
    with pytest.raises(InvalidRequestError) as info:
        cd.choose_dtype("bfloat17", AVX2, field=FIELD)
    assert info.value.field == FIELD


# ------------------------------------------------------------------------------------------------
# this machine


def test_probe_of_this_cpu_agrees_with_what_torch_reports():
    device = cd.probe_device("cpu")
    reported = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert device.native_bf16 == reported
    assert torch.backends.cpu.get_cpu_capability() in device.detail
    if not device.native_bf16:
        # Emulated bf16 is measurably slower: the warning's number is a real measurement.
        assert cd.measured_slowdown("cpu").slowdown > 1.0


def test_resolve_logs_once_and_warns_for_emulated_bf16(caplog, monkeypatch):
    monkeypatch.setattr(cd, "probe_device", lambda device_type: AVX2)
    monkeypatch.setattr(cd, "measured_slowdown", lambda device_type: AVX2)
    cd._announce.cache_clear()
    with caplog.at_level(logging.INFO, logger=cd.__name__):
        assert cd.resolve_compute_dtype("auto", "cpu", field=FIELD) is torch.float32
        assert cd.resolve_compute_dtype("auto", "cpu", field=FIELD) is torch.float32
        with pytest.warns(RuntimeWarning, match="37x slower"):
            assert cd.resolve_compute_dtype("bfloat16", "cpu", field=FIELD) is torch.bfloat16
    lines = [r.getMessage() for r in caplog.records if r.message.startswith("compute dtype")]
    assert lines == [
        f"compute dtype: {FIELD}=auto -> float32 on cpu (no native bf16: {AVX2.detail})",
        f"compute dtype: {FIELD}=bfloat16 on cpu ({AVX2.detail})",
    ]
    cd._announce.cache_clear()


def test_explicit_float32_needs_no_probe(monkeypatch):
    def fail(device_type):
        raise AssertionError("float32 must not probe the hardware")

    monkeypatch.setattr(cd, "probe_device", fail)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cd.resolve_compute_dtype("float32", "cpu", field=FIELD) is torch.float32


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 decides by CPU flags"
)
def test_auto_on_x86_costs_no_probe(monkeypatch):
    """On x86 torch's CPU flags decide; the ~0.5 s matmul probe runs only to put a number in the
    warning about an explicit bf16, never at an `auto` start-up."""

    def fail(*args, **kwargs):
        raise AssertionError("auto must not time matmuls on x86")

    monkeypatch.setattr(cd, "probe_bf16_slowdown", fail)
    cd.probe_device.cache_clear()
    cd._announce.cache_clear()
    try:
        native = cd.probe_device("cpu").native_bf16
        expected = torch.bfloat16 if native else torch.float32
        assert cd.resolve_compute_dtype("auto", "cpu", field=FIELD) is expected
    finally:
        cd.probe_device.cache_clear()
        cd._announce.cache_clear()
