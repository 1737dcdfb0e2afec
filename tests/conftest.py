"""Shared fixtures and marker handling for the whole test suite.

Markers (registered in pyproject.toml):
- `gpu`: needs a CUDA GPU; skipped automatically when torch.cuda.is_available() is False.
- `vllm`: needs vllm importable; skipped automatically when it is not installed.
- `slow`: long-running; `make test` deselects them with -m "not slow".

Model fixtures:
- `smollm2_dir` (session): the packaged SmolLM2-135M-Instruct converted to a Hugging Face folder, in the
  default cache (`$SKYRL_CACHE_DIR` or ~/.cache/skyrl_trainer), so the ~30 s conversion happens once per
  machine, not once per run.
- `tokenizer` (session): its tokenizer.
- `tiny_model_dir` (session): a tiny random Llama with the real tokenizer, for fast unit tests.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# Tests never use the network: set before anything imports huggingface_hub / wandb.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(item.get_closest_marker("gpu") for item in items):
        import torch

        if not torch.cuda.is_available():
            skip_gpu = pytest.mark.skip(
                reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
            )
            for item in items:
                if item.get_closest_marker("gpu"):
                    item.add_marker(skip_gpu)
    if importlib.util.find_spec("vllm") is None:
        skip_vllm = pytest.mark.skip(reason="needs vllm (not installed)")
        for item in items:
            if item.get_closest_marker("vllm"):
                item.add_marker(skip_vllm)


TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32: the smallest vLLM's CPU attention supports
    num_key_value_heads=1,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted packaged SmolLM2-135M-Instruct folder (converted once into the default cache)."""
    from skyrl_trainer.backend.model_loading import resolve_model_dir

    return resolve_model_dir("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir: Path):
    """The SmolLM2 tokenizer (ChatML chat template, eos = pad = <|im_end|> = id 2)."""
    from skyrl_trainer.backend.model_loading import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> Path:
    """A tiny random-initialised Llama (2 layers, width 64, seeded) saved with the real tokenizer,
    so it loads with load_tokenizer / load_causal_lm like a real model folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama")
    config = LlamaConfig(vocab_size=len(tokenizer), **TINY_CONFIG)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a test module (use: `pytestmark = pytest.mark.usefixtures(...)`).
    The tiny model's ops gain nothing from threads and lose a lot on a busy machine; engines
    started in the module inherit the count, so in-process and actor engines compute alike
    (thread counts can change float reduction order)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_session():
    """A local 2-CPU Ray for one test module (reused if this process already runs one)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()
