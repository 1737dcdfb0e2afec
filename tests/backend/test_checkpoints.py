"""Tests for skyrl_trainer.backend.checkpoints.CheckpointStore (no model needed)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from skyrl_trainer.backend.checkpoints import (
    METADATA_FILE,
    CheckpointMetadata,
    CheckpointStore,
    check_checkpoint_name,
)
from skyrl_trainer.backend.errors import InvalidRequestError, NotFoundError

RUN = "abc123:train:0"


def metadata(**overrides) -> CheckpointMetadata:
    fields = dict(
        base_model="tiny",
        is_lora=True,
        lora_rank=8,
        lora_config={
            "rank": 8,
            "seed": 0,
            "train_mlp": True,
            "train_attn": True,
            "train_unembed": True,
        },
        model_id=RUN,
        has_optimizer=True,
        created_at=time.time(),
    )
    fields.update(overrides)
    return CheckpointMetadata(**fields)


def writer(content: str):
    def write_files(folder: Path) -> None:
        (folder / "weights.bin").write_text(content)

    return write_files


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "storage")


def all_entries(store: CheckpointStore) -> list[str]:
    if not store.root.exists():
        return []
    return sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*"))


def test_write_and_resolve(store):
    meta = metadata(user_metadata={"k": "v"})
    path = store.write(RUN, "training", "step_10", meta, writer("w1"))
    assert path == f"tinker://{RUN}/weights/step_10"
    assert path == store.tinker_path(RUN, "training", "step_10")
    folder, loaded = store.resolve(path)
    assert folder == store.root / RUN / "weights" / "step_10"
    assert loaded == meta
    assert loaded.lora().rank == 8
    assert (folder / "weights.bin").read_text() == "w1"
    assert json.loads((folder / METADATA_FILE).read_text())["model_id"] == RUN

    sampler = store.write(RUN, "sampler", "s1", metadata(), writer("s"))
    assert sampler == f"tinker://{RUN}/sampler_weights/s1"
    assert store.resolve(sampler)[0] == store.root / RUN / "sampler_weights" / "s1"
    # Full fine-tuning metadata has no LoRA config.
    assert metadata(is_lora=False, lora_rank=None, lora_config=None).lora() is None


def test_failed_write_leaves_nothing_behind(store):
    def half_written(folder: Path) -> None:
        (folder / "weights.bin").write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.write(RUN, "training", "broken", metadata(), half_written)
    # No final folder, no hidden staging folder.
    assert not any("broken" in entry for entry in all_entries(store)), all_entries(store)
    with pytest.raises(NotFoundError) as info:
        store.resolve(f"tinker://{RUN}/weights/broken")
    assert info.value.field == "path"
    # A later save of the same name works (nothing left that blocks it).
    store.write(RUN, "training", "broken", metadata(), writer("ok"))
    assert (store.resolve(f"tinker://{RUN}/weights/broken")[0] / "weights.bin").read_text() == "ok"


def test_overwrite_replaces_and_is_required(store):
    old = metadata(created_at=1.0)
    path = store.write(RUN, "training", "ckpt", old, writer("old"))
    with pytest.raises(InvalidRequestError) as info:
        store.write(RUN, "training", "ckpt", metadata(), writer("new"))
    assert info.value.field == "name"
    folder, meta = store.resolve(path)
    assert (folder / "weights.bin").read_text() == "old" and meta == old

    new = metadata(created_at=2.0, lora_rank=4)
    assert store.write(RUN, "training", "ckpt", new, writer("new"), overwrite=True) == path
    folder, meta = store.resolve(path)
    assert (folder / "weights.bin").read_text() == "new" and meta == new
    # No leftover staging or trash folders next to it.
    assert sorted(p.name for p in folder.parent.iterdir()) == ["ckpt"]


def test_failed_overwrite_keeps_the_old_checkpoint(store):
    path = store.write(RUN, "training", "ckpt", metadata(), writer("old"))

    def fails(folder: Path) -> None:
        (folder / "weights.bin").write_text("half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        store.write(RUN, "training", "ckpt", metadata(), fails, overwrite=True)
    folder, _ = store.resolve(path)
    assert (folder / "weights.bin").read_text() == "old"
    assert sorted(p.name for p in folder.parent.iterdir()) == ["ckpt"]


def test_overwrite_also_applies_to_a_new_name(store):
    path = store.write(RUN, "training", "fresh", metadata(), writer("x"), overwrite=True)
    assert store.resolve(path)[0].name == "fresh"


@pytest.mark.parametrize("name", ["a", "step_0010", "final-v2.1", "A" * 128, "0"])
def test_valid_names(name):
    assert check_checkpoint_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "..",
        ".",
        "../x",
        "a/b",
        "/abs",
        ".hidden",
        "-dash",
        "a..b",
        "A" * 129,
        "a b",
        "a\x00",
        "é",
        None,
        5,
    ],
)
def test_invalid_names(store, name):
    with pytest.raises(InvalidRequestError) as info:
        check_checkpoint_name(name)
    assert info.value.field == "name"
    with pytest.raises(InvalidRequestError):
        store.write(RUN, "training", name, metadata(), writer("x"))
    assert all_entries(store) == []


def test_expired_checkpoints_are_not_found(store):
    now = time.time()
    expired = store.write(RUN, "training", "old", metadata(expires_at=now - 1), writer("x"))
    alive = store.write(RUN, "training", "new", metadata(expires_at=now + 3600), writer("x"))
    forever = store.write(RUN, "training", "forever", metadata(expires_at=None), writer("x"))
    with pytest.raises(NotFoundError) as info:
        store.resolve(expired)
    assert info.value.field == "path" and "expired" in str(info.value)
    assert store.resolve(alive)[1].expires_at == pytest.approx(now + 3600)
    assert store.resolve(forever)[1].expires_at is None


def test_an_expired_checkpoint_frees_its_name(store):
    path = store.write(RUN, "training", "ttl", metadata(expires_at=time.time() - 1), writer("a"))
    with pytest.raises(NotFoundError):
        store.resolve(path)
    store.write(RUN, "training", "ttl", metadata(), writer("b"))
    assert (store.resolve(path)[0] / "weights.bin").read_text() == "b"


def test_set_expiry_and_delete(store):
    path = store.write(RUN, "training", "ttl", metadata(expires_at=time.time() - 1), writer("a"))
    store.set_expiry(path, None)  # an expired checkpoint made permanent again
    assert store.resolve(path)[1].expires_at is None
    store.set_expiry(path, time.time() - 1)
    with pytest.raises(NotFoundError):
        store.resolve(path)
    store.set_expiry(f"tinker://{RUN}/weights/missing", None)  # nothing there: no error
    assert store.delete(path) and not store.folder_of(path).exists()
    assert not store.delete(path)
    assert all_entries(store) == [RUN, f"{RUN}/weights"]


@pytest.mark.parametrize("path", ["tinker://a/weights/..", "tinker://a/weights/.x"])
def test_bad_name_segment_is_reported_with_the_callers_field(store, path):
    with pytest.raises(InvalidRequestError) as info:
        store.resolve(path, field="model_path")
    assert info.value.field == "model_path"


@pytest.mark.parametrize(
    "path",
    [
        "/etc/passwd",
        "weights/x",
        "tinker://a/b",
        "tinker://a/weights/x/y",
        "tinker://a/unknown/x",
        "tinker://a/external_weights/x",
        "tinker://../weights/x",
        "tinker://./weights/x",
        "tinker://.hidden/weights/x",
        "tinker:///weights/x",
        "tinker://a/weights/",
        "",
        None,
        42,
    ],
)
def test_malformed_paths(store, path):
    with pytest.raises(InvalidRequestError) as info:
        store.resolve(path, field="model_path")
    assert not isinstance(info.value, NotFoundError)


@pytest.mark.parametrize("path", ["/etc/passwd", "tinker://a/b", "tinker://../weights/x", None])
def test_resolve_names_the_callers_field(store, path):
    with pytest.raises(InvalidRequestError) as info:
        store.resolve(path, field="model_path")
    assert info.value.field == "model_path"


def test_unknown_checkpoint_is_not_found(store):
    store.write(RUN, "training", "exists", metadata(), writer("x"))
    for path in (
        f"tinker://{RUN}/weights/missing",
        "tinker://other-run/weights/exists",
        f"tinker://{RUN}/sampler_weights/exists",
    ):
        with pytest.raises(NotFoundError) as info:
            store.resolve(path)
        assert info.value.field == "path"
