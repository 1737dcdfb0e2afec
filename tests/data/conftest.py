"""Fixtures for the data tests: a private `datasets` cache, and the shared GSM8K files."""

from __future__ import annotations

from pathlib import Path

import pytest

GSM8K_DIR = Path("/work/shared/datasets/gsm8k")


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    # Loading tmp_path files would otherwise leave a new cache entry in ~/.cache on every run.
    import datasets

    cache = tmp_path_factory.getbasetemp() / "hf_datasets_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)


@pytest.fixture
def gsm8k_dir() -> Path:
    """The shared GSM8K folder (train.jsonl, test.jsonl); skips the test when it is absent."""
    if not all((GSM8K_DIR / f"{split}.jsonl").is_file() for split in ("train", "test")):
        pytest.skip(f"GSM8K data (train.jsonl, test.jsonl) not found at {GSM8K_DIR}")
    return GSM8K_DIR
