"""glibc malloc settings for the long-running entry points (trainer, server).

CPU torch frees and re-allocates many multi-megabyte tensors (logits, KV-cache growth, merged LoRA
weight copies) from several threads. glibc raises its mmap threshold to the largest block freed so
far (up to 32 MiB), after which such tensors come from per-thread heap arenas that fragment and are
rarely returned to the OS. Measured on the gsm8k_grpo recipe in float32 (2-core AMD EPYC): peak RSS
of 4 steps 8.8 GB with the defaults, 6.2 GB with a fixed 1 MiB threshold and 2 arenas; of the whole
recipe 12.4 GB and 10.4 GB; step times unchanged within run-to-run noise. Where glibc is absent
(macOS, musl) nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers (malloc.h)
M_ARENA_MAX = -8


def tune_malloc(mmap_threshold: int = 1 << 20, arena_max: int = 2) -> bool:
    """Fix glibc's mmap threshold (blocks this large are mmapped and freed back to the OS) and
    cap its arenas. Call early, before threads start. True if glibc accepted both settings."""
    if platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_ARENA_MAX, arena_max) == 1
    if not ok:
        logger.debug("glibc refused the malloc settings; keeping its defaults")
    return ok
