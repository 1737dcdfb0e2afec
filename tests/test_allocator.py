"""The entry points' glibc malloc settings (skyrl_trainer/allocator.py)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from skyrl_trainer.allocator import tune_malloc


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc settings")
def test_freed_tensors_go_back_to_the_os():
    """After tune_malloc, a freed 4 MiB tensor no longer stays resident: allocate 200 of them,
    free them, and the process's RSS falls back (with the defaults glibc keeps most of it)."""
    script = (
        "import sys, torch\n"
        "from skyrl_trainer.allocator import tune_malloc\n"
        "if sys.argv[1] == 'tuned': assert tune_malloc()\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20\n"
        "warm = [torch.ones(2**20) for _ in range(4)]; del warm\n"  # raises the default threshold
        "base = rss()\n"
        "keep = [torch.ones(2**20 + i) for i in range(200)]\n"
        "del keep\n"
        "print(rss() - base)\n"
    )
    left = {
        mode: float(subprocess.check_output([sys.executable, "-c", script, mode], text=True))
        for mode in ("default", "tuned")
    }
    assert left["tuned"] < 50, left  # MiB still resident after freeing 800 MiB
    assert left["default"] > left["tuned"]


def test_tune_malloc_is_harmless_to_call_again():
    assert tune_malloc() in (True, False)
    assert tune_malloc() in (True, False)
