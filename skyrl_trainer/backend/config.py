"""Configuration of the in-process backend (typed dataclasses; Hydra fills them in the trainer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from skyrl_trainer.backend.model_loading import default_cache_dir


@dataclass
class RayConfig:
    """The Ray cluster that multi-worker training (`training.num_workers > 1`) runs on."""

    address: str | None = None
    """An existing cluster to join ("host:port" of its head, "auto", or "ray://host:port").
    None: the Ray already initialised in this process, else a new local one."""
    num_cpus: int | None = None
    """A new local Ray only: the CPUs it offers (default: all of this machine's)."""
    connect_timeout_s: float = 60.0
    """Most seconds to reach `address` and start or join Ray; beyond it start-up fails."""


@dataclass
class TrainingConfig:
    """How training workers compute."""

    dtype: str = "auto"
    """Compute dtype. "auto": bfloat16 where the device computes it natively (CUDA with bf16,
    CPUs with AMX or AVX512-BF16), else float32 (`compute_dtype`). bfloat16: frozen LoRA base
    stored in bf16, float32 trainable weights, bf16 autocast (3-4x faster than float32 where
    native, 20-100x slower where emulated). float32: exact arithmetic."""
    device: str = "auto"
    """"auto" (cuda when available, else cpu), "cpu" or "cuda"."""
    micro_batch_tokens: int = 2048
    """Padded tokens (rows x longest) per forward/backward micro-batch at 2-byte (bf16)
    activations: bounds activation memory. float32 compute runs half as many per micro-batch, so
    the bound holds in bytes whatever the dtype."""
    logprob_chunk_tokens: int = 1024
    """Rows per chunk of the float32 softmax math over the vocabulary."""
    recompute_logits: bool = False
    """False: the logits of a micro-batch are kept (in the compute dtype) for backward.
    True: the vocabulary projection is recomputed chunk by chunk in backward, so only one
    chunk's logits exist at a time (less memory, one extra projection)."""
    num_workers: int = 1
    """Training processes per base model. 1: one in-process worker (no Ray). More: that many
    Ray actors in one placement group, each a replica in a torch.distributed group; a request's
    examples are split across them by token count and their gradients summed."""
    num_cpus_per_worker: float = 1.0
    """Ray CPUs each worker reserves (num_workers > 1)."""
    num_gpus_per_worker: float | None = None
    """Ray GPUs each worker reserves. None: 1 when `device` is "cuda", or "auto" and the Ray
    cluster has GPUs; else 0 (a worker without a GPU computes on CPU)."""
    shard_full_models: bool = True
    """num_workers > 1: full fine-tuning models are sharded across the workers with FSDP2
    (parameters, gradients and optimizer state; CPU/gloo and CUDA/nccl). False: every worker
    holds a full replica (plain data parallel). LoRA models are always replicated."""
    placement_strategy: str = "PACK"
    """Ray placement-group strategy for the workers: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD."""
    startup_timeout_s: float = 180.0
    """Most seconds to wait for the workers' resources, start-up and process group; beyond
    it the backend fails with a message naming the fields to change, never hangs."""
    collective_timeout_s: float = 300.0
    """torch.distributed timeout: a worker waiting in a collective for a peer that is gone
    (or stuck) gives up after this, so a failed worker can never hang the backend."""
    ray: RayConfig = field(default_factory=lambda: RayConfig())


@dataclass
class SamplingConfig:
    """How sampling engines run and what a sample request may ask for."""

    engine: str = "auto"
    """"vllm", "torch" (the PyTorch engine), or "auto": vLLM when it is installed, else torch."""
    dtype: str = "auto"
    """What the engines' weights and compute are in; "auto" as for training."""
    device: str = "auto"
    max_batch_size: int = 128
    """Most sequences decoding at once per engine; more requests wait and join as rows finish."""
    max_num_samples: int = 128
    """Cap on `num_samples` per request."""
    max_tokens: int = 4096
    """Cap on `sampling_params.max_tokens` (also bounded by the context length)."""
    max_lora_snapshots: int = 8
    """LoRA snapshots kept live per model; sessions bound to older ones get a clear error."""
    max_merged_lora: int = 2
    """PyTorch engine: adapters kept merged into a copy of the weights they adapt (each costs that
    much memory); a request for another adapter merges it anew (~0.5 s for SmolLM2 r32 on CPU)."""
    prefix_cache_tokens: int = 16384
    """PyTorch engine: most tokens of finished sequences' KV kept so that a later prompt extending
    one (a multi-turn rollout's next turn) prefills only its new tokens; LRU, 0 disables. Each
    token costs layers * 2 * kv_heads * head_dim * dtype bytes (SmolLM2-135M float32: 45 KiB, so
    the default holds at most ~720 MiB)."""
    max_lora_rank: int = 32
    """vLLM: the largest LoRA rank it serves (one of 8, 16, 32, 64, 128, 256, 320, 512)."""
    kv_cache_gib: float | None = None
    """vLLM: KV-cache size per engine; default 2 GiB on CPU, `gpu_memory_utilization` on GPU."""
    gpu_memory_utilization: float = 0.5
    """vLLM on GPU: the share of GPU memory an engine may take (the trainer needs the rest)."""
    num_engines: int = 1
    """Engine replicas per served model. 1: the engine runs in this process (no Ray). More: each
    replica is a Ray actor (`sampling.engine_pool.EnginePool`); requests are routed with prefix
    affinity and every weight or adapter sync reaches all replicas before it returns."""
    engines_as_actors: bool = False
    """Run the engine as a Ray actor even when num_engines is 1: a process of its own with
    `num_cpus_per_engine` torch threads, so sampling does not share the trainer's threads (what
    asynchronous RL on one machine wants: sampler and learner each on their own cores)."""
    num_cpus_per_engine: float = 1.0
    """Ray CPUs each engine actor reserves (num_engines > 1); also its torch threads (at least 1)."""
    num_gpus_per_engine: float | None = None
    """Ray GPUs each engine actor reserves. None: on a cluster with GPUs (or `device` "cuda"),
    1 ("separate") or 0.5 ("colocated"); else 0 (the engine computes on CPU)."""
    engine_placement: str = "separate"
    """"separate": engines reserve resources of their own. "colocated": engines are meant to share
    the trainer's GPUs, and sleep (vLLM sleep mode) while a forward_backward runs, waking on their
    next request or weight sync. On CPU both are plain actors. Colocation is untested on GPU."""
    affinity_prefix_tokens: int = 64
    """Routing key: the sampler session and this many leading prompt tokens. Requests sharing
    them go to the same engine (its prefix cache), unless that engine has `max_batch_size`
    more rows in flight than the least loaded one."""
    engine_startup_timeout_s: float = 300.0
    """Most seconds for the engine actors' resources and start-up (num_engines > 1)."""
    weight_sync: str = "object_store"
    """How full weights reach engine actors (num_engines > 1). "object_store": put once in Ray's
    object store, each engine reads them. "broadcast": a process group of the pool and its engines
    (`sampling.weight_broadcast`; gloo on CPU, NCCL when the engines hold GPUs), tensors sent as
    flat buckets. Tested with gloo on CPU; the NCCL path has not run on a GPU yet."""
    weight_sync_timeout_s: float = 120.0
    """"broadcast": most seconds a collective waits for a peer before it fails."""


@dataclass
class BackendConfig:
    """The in-process Tinker backend."""

    base_models: list[str] = field(default_factory=lambda: ["SmolLM2-135M-Instruct"])
    """Models advertised by get_server_capabilities. In-process, any other resolvable name or
    path is accepted on demand (a hub id, a local Hugging Face folder, a packaged model); the
    HTTP server (`BackendCore(served_only=True)`) serves these only (`backend.base_models`)."""
    storage_dir: str | None = None
    """Root of tinker:// checkpoints; default <cache_dir>/storage."""
    cache_dir: str | None = None
    """Converted models and other caches; default $SKYRL_CACHE_DIR or ~/.cache/skyrl_trainer."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()

    def resolved_storage_dir(self) -> Path:
        if self.storage_dir:
            return Path(self.storage_dir).expanduser()
        return self.resolved_cache_dir() / "storage"


def backend_config_from_dict(data: dict | None, field: str = "backend") -> BackendConfig:
    """A BackendConfig from nested plain values; unknown keys and wrong types are refused by name."""
    from skyrl_trainer.typed_config import build_config

    return build_config(dict(data or {}), BackendConfig, prefix=field)
