"""Checkpoint storage: `tinker://<run>/<kind>/<name>` paths mapped onto folders, written atomically.

Layout: `<storage>/<run>/weights/<name>/` (training state) and
`<storage>/<run>/sampler_weights/<name>/` (weights for samplers), each with `metadata.json`
beside the weight files. A checkpoint is written into a hidden temporary folder and renamed
into place, so an interrupted save never leaves a folder that loads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from tinker import types

from skyrl_trainer.backend.errors import InvalidRequestError, NotFoundError

KIND_DIRS = {"training": "weights", "sampler": "sampler_weights"}
METADATA_FILE = "metadata.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class CheckpointMetadata:
    """What a checkpoint was made from; checked before loading it anywhere."""

    base_model: str
    is_lora: bool
    lora_rank: int | None
    lora_config: dict | None  # tinker LoraConfig fields
    model_id: str
    has_optimizer: bool
    created_at: float
    expires_at: float | None = None
    user_metadata: dict[str, str] | None = None

    def lora(self) -> types.LoraConfig | None:
        return types.LoraConfig(**self.lora_config) if self.lora_config else None


def check_checkpoint_name(name: object, field: str = "name") -> str:
    """Refuse names that are empty, too long, or could escape the storage folder."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
        raise InvalidRequestError(
            field,
            f"{name!r} is not a valid checkpoint name: use 1-128 letters, digits, '.', '_' "
            "or '-', starting with a letter or digit",
        )
    return name


class CheckpointStore:
    """Maps tinker:// paths to folders under one storage root."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def tinker_path(self, run_id: str, kind: str, name: str) -> str:
        return f"tinker://{run_id}/{KIND_DIRS[kind]}/{name}"

    def folder(self, run_id: str, kind: str, name: str) -> Path:
        return self.root / run_id / KIND_DIRS[kind] / name

    def folder_of(self, tinker_path: object, field: str = "path") -> Path:
        """The folder a checkpoint path names (whether or not it exists); paths that could
        leave the storage root are refused."""
        if not isinstance(tinker_path, str):
            raise InvalidRequestError(
                field, f"must be a tinker:// path string, got {tinker_path!r}"
            )
        try:
            parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        except ValueError:
            raise InvalidRequestError(
                field,
                f"{tinker_path!r} is not a checkpoint path; expected "
                "tinker://<run>/weights/<name> or tinker://<run>/sampler_weights/<name>",
            ) from None
        name = parsed.checkpoint_id.split("/", 1)[1]
        if parsed.checkpoint_type not in KIND_DIRS or "/" in parsed.training_run_id:
            raise InvalidRequestError(field, f"unsupported checkpoint path {tinker_path!r}")
        check_checkpoint_name(name, field)
        if parsed.training_run_id in ("", ".", "..") or parsed.training_run_id.startswith("."):
            raise InvalidRequestError(field, f"invalid run id in {tinker_path!r}")
        return self.folder(parsed.training_run_id, parsed.checkpoint_type, name)

    def resolve(self, tinker_path: object, field: str = "path") -> tuple[Path, CheckpointMetadata]:
        """The folder and metadata of an existing checkpoint; clear errors otherwise."""
        folder = self.folder_of(tinker_path, field)
        metadata = _read_metadata(folder)
        if metadata is None:
            raise NotFoundError(field, f"no checkpoint at {tinker_path!r}")
        if _is_expired(metadata):
            raise NotFoundError(field, f"checkpoint {tinker_path!r} has expired")
        return folder, CheckpointMetadata(**metadata)

    def set_expiry(self, tinker_path: str, expires_at: float | None) -> None:
        """Change when a checkpoint expires (None: never); its metadata file is replaced
        atomically. A checkpoint that is not there is left alone."""
        meta_file = self.folder_of(tinker_path) / METADATA_FILE
        metadata = _read_metadata(meta_file.parent)
        if metadata is None:
            return
        metadata["expires_at"] = expires_at
        staging = meta_file.with_name(f".{METADATA_FILE}.{uuid.uuid4().hex[:8]}")
        staging.write_text(json.dumps(metadata, indent=2))
        os.replace(staging, meta_file)

    def delete(self, tinker_path: str) -> bool:
        """Remove a checkpoint (renamed aside first, so a half-deleted folder never loads).
        False when there was none."""
        folder = self.folder_of(tinker_path)
        if not folder.exists():
            return False
        trash = folder.parent / f".{folder.name}.deleted-{uuid.uuid4().hex[:8]}"
        folder.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
        return True

    @contextmanager
    def _staging_folder(self, final: Path, overwrite: bool) -> Iterator[Path]:
        if final.exists() and not overwrite and not _is_expired(_read_metadata(final)):
            raise InvalidRequestError(
                "name",
                f"checkpoint {final.name!r} already exists; pass overwrite=True to replace it",
            )
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        try:
            yield staging
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def write(
        self,
        run_id: str,
        kind: str,
        name: str,
        metadata: CheckpointMetadata,
        write_files: Callable[[Path], None],
        overwrite: bool = False,
    ) -> str:
        """Create a checkpoint: `write_files(folder)` fills a staging folder, which is then
        renamed into place (replacing an old one only with `overwrite`). Returns its path."""
        final = self.folder(run_id, kind, check_checkpoint_name(name))
        with self._staging_folder(final, overwrite) as staging:
            write_files(staging)
            (staging / METADATA_FILE).write_text(json.dumps(asdict(metadata), indent=2))
            if final.exists():
                trash = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
                final.rename(trash)
                staging.rename(final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                staging.rename(final)
        return self.tinker_path(run_id, kind, name)


def _read_metadata(folder: Path) -> dict | None:
    """The checkpoint's metadata, or None where there is no (readable) checkpoint."""
    try:
        return json.loads((folder / METADATA_FILE).read_text())
    except (OSError, ValueError):
        return None


def _is_expired(metadata: dict | None) -> bool:
    """True when the checkpoint's TTL has passed (an expired name may be reused)."""
    expires_at = (metadata or {}).get("expires_at")
    return expires_at is not None and expires_at < time.time()
