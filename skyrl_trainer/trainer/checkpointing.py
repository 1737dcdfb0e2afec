"""Loop state for exact resume: which step, where the data stream is, the training checkpoint's
tinker:// path. Written atomically next to the run's metrics, one folder per checkpoint."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_FILE = "loop_state.json"


@dataclass
class LoopState:
    step: int  # steps completed
    stream: dict  # PromptStream.state_dict()
    training_path: str  # tinker://.../weights/<name>: weights and optimizer state
    sampler_path: str | None = None


def checkpoint_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_loop_state(output_dir: Path, state: LoopState) -> Path:
    """Write `checkpoints/step-<N>/loop_state.json` atomically (a reader never sees half a file)."""
    folder = checkpoint_dir(output_dir) / f"step-{state.step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(state), f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / STATE_FILE)
    return folder / STATE_FILE


def latest_loop_state(output_dir: Path) -> LoopState | None:
    """The newest complete loop state under `output_dir`, or None."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return None
    for folder in sorted(root.glob("step-*"), reverse=True):
        path = folder / STATE_FILE
        if path.is_file():
            return LoopState(**json.loads(path.read_text()))
    return None
