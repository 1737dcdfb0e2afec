"""Loop state for exact resume: which step, where the data stream is, the training checkpoint's
tinker:// path, and (asynchronous runs) what the batch pipeline had sampled but not trained.
Written atomically next to the run's metrics, one folder per checkpoint; `loop_state.json` is
written last, so a folder without it (an interrupted save) is never resumed from."""

from __future__ import annotations

import json
import os
import pickle
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_FILE = "loop_state.json"
PIPELINE_FILE = "pipeline.pkl"


@dataclass
class LoopState:
    step: int  # steps completed
    stream: dict  # PromptStream.state_dict()
    training_path: str  # tinker://.../weights/<name>: weights and optimizer state
    sampler_path: str | None = None
    pipeline_file: str | None = None  # the async pipeline's pending groups, beside this file


def checkpoint_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _write_atomically(path: Path, write, mode: str = "w") -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_loop_state(output_dir: Path, state: LoopState, pipeline: dict | None = None) -> Path:
    """Write `checkpoints/step-<N>/loop_state.json` atomically (a reader never sees half a file),
    after the pipeline's pending payload (`pipeline.pkl`) when there is one."""
    folder = checkpoint_dir(output_dir) / f"step-{state.step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    if pipeline is not None:
        _write_atomically(folder / PIPELINE_FILE, lambda f: pickle.dump(pipeline, f), "wb")
        state.pipeline_file = PIPELINE_FILE
    _write_atomically(folder / STATE_FILE, lambda f: json.dump(asdict(state), f, indent=2))
    return folder / STATE_FILE


def load_pipeline(output_dir: Path, state: LoopState) -> dict | None:
    """The pending payload saved with `state` (this run's own file), or None."""
    if state.pipeline_file is None:
        return None
    path = checkpoint_dir(output_dir) / f"step-{state.step:06d}" / state.pipeline_file
    with open(path, "rb") as f:
        return pickle.load(f)


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
