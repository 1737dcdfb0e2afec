"""Fixtures shared by the backend tests. Each test module defines its own module-scoped `core`
(a `BackendCore` configured for that module); `sc` is a session on it."""

import pytest

from skyrl_trainer.backend.clients import ServiceClient


@pytest.fixture(scope="module")
def sc(core) -> ServiceClient:
    return ServiceClient(core=core)


@pytest.fixture(scope="module")
def vocab(tiny_model_dir) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
