"""The compute dtype: `auto` picks bfloat16 only where the hardware computes it natively.

bfloat16 halves memory traffic and is 3-4x faster than float32 on GPUs with bf16 support and on CPUs
with AMX or AVX512-BF16. Everywhere else (AVX2-only x86 such as AMD EPYC before Zen 4, most laptops)
torch emulates bf16 matmuls, 20-100x slower than float32. So `auto` asks the device what it does,
and an explicit `bfloat16` on a CPU without native support runs, with a warning that names the
measured slowdown and the setting to change.

`choose_dtype` is the pure decision (tested for every kind of device without that hardware);
`probe_device` reads what this machine reports; `resolve_compute_dtype` puts them together.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import platform
import time
import warnings
from dataclasses import dataclass

import torch

from skyrl_trainer.backend.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}

#: A bf16 matmul at most this many times slower than float32 counts as native (the probe's bar).
NATIVE_BF16_MAX_SLOWDOWN = 2.0


def parse_dtype(name: str | torch.dtype, *, field: str = "dtype") -> torch.dtype:
    """`"bfloat16"`/`"bf16"`, `"float32"`/`"fp32"`, `"float16"`/`"fp16"` (any case, optional
    `torch.` prefix) -> the torch dtype. A torch dtype among those is returned unchanged.
    (`"auto"` is not a dtype: resolve it with `resolve_compute_dtype`.)"""
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
        key = str(name)
    else:
        key = str(name).strip().lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    allowed = ", ".join(repr(k) for k in ["auto", *_DTYPES])
    raise InvalidRequestError(field, f"unknown dtype {name!r}; use one of {allowed}")


@dataclass(frozen=True)
class DeviceBf16:
    """What a device reports about bfloat16 arithmetic."""

    device_type: str  # "cpu" or "cuda"
    native_bf16: bool
    detail: str  # why, for the start-up line: "CPU capability AVX2, no AVX512-BF16/AMX"
    slowdown: float | None = None  # measured bf16/float32 matmul time, where a probe ran


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # one line: what was asked, what was chosen, and why
    warning: str | None = None  # set when an explicit bf16 will be emulated (slow)


def choose_dtype(requested: str | torch.dtype, device: DeviceBf16, *, field: str) -> DtypeChoice:
    """The compute dtype for `requested` ("auto" or a dtype name) on `device`."""
    if str(requested).strip().lower() == "auto":
        dtype = torch.bfloat16 if device.native_bf16 else torch.float32
        verdict = "native bf16" if device.native_bf16 else "no native bf16"
        reason = (
            f"{field}=auto -> {_short(dtype)} on {device.device_type} ({verdict}: {device.detail})"
        )
        return DtypeChoice(dtype, reason)
    dtype = parse_dtype(requested, field=field)
    reason = f"{field}={_short(dtype)} on {device.device_type} ({device.detail})"
    warning = None
    emulated = device.device_type == "cpu" and not device.native_bf16
    if dtype in (torch.bfloat16, torch.float16) and emulated:
        measured = (
            f"measured {device.slowdown:.0f}x slower than float32 here"
            if device.slowdown
            else "typically 20-100x slower than float32"
        )
        warning = (
            f"{field}={_short(dtype)} on a CPU without native {_short(dtype)} matmul "
            f"({device.detail}): torch emulates it, {measured}. "
            f"Set {field}=auto (or float32) for full speed."
        )
    return DtypeChoice(dtype, reason, warning)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------
# what this machine reports


def probe_bf16_slowdown(rows: int = 128, dim: int = 576, out: int = 1536) -> float:
    """Time of a bf16 matmul of a transformer layer's shape (a 128-token slice through SmolLM2's
    MLP) over the same in float32: about 1 where bf16 is native, 15-60 on AVX2-only CPUs. Takes
    under 0.1 s where native and about half a second where emulated."""

    def timed(dtype: torch.dtype, repeats: int) -> float:
        a, b = torch.randn(rows, dim, dtype=dtype), torch.randn(dim, out, dtype=dtype)
        a[:8] @ b  # warm-up: kernel selection and packing
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return best

    return timed(torch.bfloat16, 1) / max(timed(torch.float32, 3), 1e-9)


@functools.cache
def probe_device(device_type: str) -> DeviceBf16:
    """What `device_type` ("cpu"/"cuda") of this machine does with bf16 (cached per process).

    CUDA: `torch.cuda.is_bf16_supported()`. x86 CPUs: AMX-BF16 or AVX512-BF16, as torch's CPU
    feature checks report them. Other CPUs (e.g. ARM, whose bf16 extensions torch does not
    report): a sub-second matmul probe decides.
    """
    if device_type == "cuda":
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"
        native = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return DeviceBf16(
            "cuda", native, f"{name}, bf16 {'supported' if native else 'unsupported'}"
        )
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86"):
        features = [
            label
            for label, check in (
                ("AMX-BF16", getattr(torch.cpu, "_is_amx_tile_supported", None)),
                ("AVX512-BF16", getattr(torch.cpu, "_is_avx512_bf16_supported", None)),
            )
            if check is not None and check()
        ]
        if features:
            return DeviceBf16("cpu", True, f"CPU capability {capability}, {'+'.join(features)}")
        # Decided without a probe; `measured_slowdown` times it only for a warning.
        return DeviceBf16("cpu", False, f"CPU capability {capability}, no AVX512-BF16/AMX")
    slowdown = probe_bf16_slowdown()
    native = slowdown <= NATIVE_BF16_MAX_SLOWDOWN
    return DeviceBf16(
        "cpu", native, f"CPU capability {capability}, bf16 matmul {slowdown:.1f}x float32", slowdown
    )


@functools.cache
def measured_slowdown(device_type: str) -> DeviceBf16:
    """`probe_device` with the bf16/float32 matmul ratio filled in (a ~0.5 s probe where bf16
    is emulated): only for the warning about an explicit bf16, never on the `auto` path."""
    device = probe_device(device_type)
    if device.slowdown is None and device_type == "cpu" and not device.native_bf16:
        device = dataclasses.replace(device, slowdown=probe_bf16_slowdown())
    return device


@functools.cache
def _announce(reason: str, warning: str | None) -> None:
    """Log each distinct choice once per process (training and sampling may share one)."""
    logger.info("compute dtype: %s", reason)
    if warning:
        warnings.warn(warning, RuntimeWarning, stacklevel=3)
        logger.warning(warning)


def resolve_compute_dtype(
    requested: str | torch.dtype, device: torch.device | str, *, field: str
) -> torch.dtype:
    """The dtype to compute in on `device` for the config value `requested` ("auto", or a dtype
    name); logs the choice and why once, and warns about an explicit bf16 that will be emulated."""
    device_type = torch.device(device).type
    if (
        str(requested).strip().lower() != "auto"
        and parse_dtype(requested, field=field) == torch.float32
    ):
        choice = DtypeChoice(torch.float32, f"{field}=float32 on {device_type} (as configured)")
    elif device_type in ("cpu", "cuda"):
        choice = choose_dtype(requested, probe_device(device_type), field=field)
        if choice.warning:  # name the slowdown as measured on this machine
            choice = choose_dtype(requested, measured_slowdown(device_type), field=field)
    else:  # a device we know nothing about: float32 is the safe default
        choice = choose_dtype(
            requested, DeviceBf16(device_type, False, "bf16 support unknown"), field=field
        )
    _announce(choice.reason, choice.warning)
    return choice.dtype
