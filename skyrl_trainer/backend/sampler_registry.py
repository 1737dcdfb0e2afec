"""The sampler registry: which weights each sampling session serves, and the engines serving them.

A sampling session is bound once, at creation, to exactly one set of weights:
- the base model (served by the base model's shared engine);
- a LoRA snapshot: an adapter loaded into the base engine under a unique name. Several
  snapshots are live at once; the oldest beyond `max_lora_snapshots` per model are unloaded,
  and sessions bound to them fail with a clear error from then on;
- a full-weights snapshot: full fine-tuning models get an engine of their own whose weights
  are replaced in place, so only the newest snapshot is live; a session bound to an older
  one fails with a clear error. It never silently serves other weights.

An "engine" here is one in-process engine (`sampling.num_engines == 1`) or an `EnginePool` of
Ray actor replicas (more): syncs reach every replica before a binding returns, and requests are
routed by session and prompt prefix, so these semantics hold unchanged for a pool.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from skyrl_trainer.backend.config import RayConfig, SamplingConfig
from skyrl_trainer.backend.errors import InvalidRequestError, NotFoundError
from skyrl_trainer.backend.sampling.engine import (
    GenerationRequest,
    GenerationResult,
    SamplingEngine,
)
from skyrl_trainer.backend.sampling.engine_factory import make_engine, resolve_engine_kind


class StaleSnapshotError(InvalidRequestError):
    """The session's snapshot is no longer served (newer weights replaced it)."""


def make_served_engine(
    model_dir: Path, config: SamplingConfig, lora: bool, ray_config: RayConfig | None = None
) -> SamplingEngine:
    """What serves one model: one in-process engine (`config.num_engines == 1`), or an
    `EnginePool` of that many Ray actor replicas on `ray_config`'s Ray (also for one engine with
    `config.engines_as_actors`)."""
    if config.num_engines != 1 or config.engines_as_actors:
        from skyrl_trainer.backend.sampling.engine_pool import EnginePool

        return EnginePool(model_dir, config, lora=lora, ray_config=ray_config)
    return make_engine(model_dir, config, lora)


@dataclass
class SamplerBinding:
    """What one sampling session serves."""

    sampler_id: str
    base_model: str
    engine_key: str
    adapter: str | None = None
    version: int | None = None  # the full-weights version this session is bound to
    model_path: str | None = None


@dataclass
class _EngineSlot:
    engine: SamplingEngine
    base_model: str
    version: int = 0  # bumped by every in-place full-weights update
    lora_snapshots: dict[str, deque[str]] = field(default_factory=dict)  # owner -> adapters
    live_adapters: set[str] = field(default_factory=set)


class SamplerRegistry:
    """Engines per base model (and per full fine-tuning model), and the sessions bound to them."""

    def __init__(
        self,
        config: SamplingConfig,
        resolve_model_dir: Callable[[str], Path],
        ray_config: RayConfig | None = None,
    ):
        """`ray_config`: the Ray cluster engine pools use (`sampling.num_engines > 1`)."""
        self.config = config
        self.ray_config = ray_config
        self._resolve_model_dir = resolve_model_dir
        self._lock = threading.RLock()
        self._engines: dict[str, _EngineSlot] = {}
        self._sessions: dict[str, SamplerBinding] = {}
        self._ids = itertools.count()
        self._scratch = Path(tempfile.mkdtemp(prefix="skyrl-adapters-", dir=_memory_dir()))

    # ----- engines ------------------------------------------------------------------------

    def _engine(
        self, key: str, base_model: str, model_dir: Callable[[], Path], lora: bool = False
    ) -> _EngineSlot:
        with self._lock:
            slot = self._engines.get(key)
            if slot is None:
                engine = make_served_engine(model_dir(), self.config, lora, self.ray_config)
                slot = self._engines[key] = _EngineSlot(engine, base_model)
            return slot

    def _base_engine(self, base_model: str) -> _EngineSlot:
        return self._engine(base_model, base_model, lambda: self._resolve_model_dir(base_model))

    def _lora_engine_key(self, base_model: str) -> str:
        # The PyTorch engine serves base and adapter rows side by side. vLLM gets an engine of
        # its own for adapters: LoRA slows all its rows (~1.8x on CPU), and vLLM 0.32 on CPU
        # adds the last LoRA slot's delta to rows without an adapter.
        return base_model if resolve_engine_kind(self.config) == "torch" else f"{base_model}#lora"

    def _lora_engine(self, base_model: str) -> _EngineSlot:
        key = self._lora_engine_key(base_model)
        return self._engine(key, base_model, lambda: self._resolve_model_dir(base_model), True)

    def _new_session(self, **binding) -> str:
        sampler_id = f"sampler-{next(self._ids)}"
        with self._lock:
            self._sessions[sampler_id] = SamplerBinding(sampler_id=sampler_id, **binding)
        return sampler_id

    def binding(self, sampler_id: str) -> SamplerBinding:
        binding = self._sessions.get(sampler_id)
        if binding is None:
            raise NotFoundError("sampling_session_id", f"unknown sampler '{sampler_id}'")
        return binding

    # ----- binding sessions ---------------------------------------------------------------

    def bind_base(self, base_model: str) -> str:
        """A session on the base model's own weights."""
        self._base_engine(base_model)
        return self._new_session(base_model=base_model, engine_key=base_model)

    def bind_lora(
        self, owner: str, base_model: str, adapter_dir: Path, model_path: str | None = None
    ) -> str:
        """Load the PEFT adapter in `adapter_dir` as a new snapshot of `owner` (a model id or a
        checkpoint path) into the base engine, and bind a session to it."""
        slot = self._lora_engine(base_model)
        with self._lock:
            adapter = f"lora-{next(self._ids)}"
        slot.engine.add_lora(adapter, str(adapter_dir))
        with self._lock:
            slot.live_adapters.add(adapter)
            snapshots = slot.lora_snapshots.setdefault(owner, deque())
            snapshots.append(adapter)
            evicted = []
            while len(snapshots) > self.config.max_lora_snapshots:
                evicted.append(snapshots.popleft())
        for old in evicted:
            slot.live_adapters.discard(old)
            slot.engine.remove_lora(old)
        return self._new_session(
            base_model=base_model,
            engine_key=self._lora_engine_key(base_model),
            adapter=adapter,
            model_path=model_path,
        )

    def bind_lora_tensors(
        self, owner: str, base_model: str, write_adapter: Callable[[Path], None]
    ) -> str:
        """Like `bind_lora`, from an adapter written to a memory-backed scratch folder (deleted
        once the engine has loaded it: nothing reaches the disk on Linux)."""
        folder = Path(tempfile.mkdtemp(dir=self._scratch))
        try:
            write_adapter(folder)
            return self.bind_lora(owner, base_model, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def bind_full_weights(
        self, owner: str, base_model: str, named_tensors: dict[str, torch.Tensor]
    ) -> str:
        """Copy full fine-tuned weights into `owner`'s own engine in place (a new version) and
        bind a session to that version; sessions on earlier versions go stale."""
        slot = self._engine(
            f"full:{owner}", base_model, lambda: self._resolve_model_dir(base_model)
        )
        slot.engine.update_weights(named_tensors)
        with self._lock:
            slot.version += 1
            version = slot.version
        return self._new_session(base_model=base_model, engine_key=f"full:{owner}", version=version)

    def bind_full_folder(
        self, model_path: str, base_model: str, folder: Path, created_at: float
    ) -> str:
        """A session on a saved full-weights checkpoint folder (an engine of its own, keyed by
        path and creation time, so a checkpoint overwritten under its name gets a new one)."""
        key = f"full:{model_path}@{created_at}"
        self._engine(key, base_model, lambda: folder)
        return self._new_session(
            base_model=base_model, engine_key=key, version=0, model_path=model_path
        )

    # ----- sampling -----------------------------------------------------------------------

    def generate(self, sampler_id: str, request: GenerationRequest) -> Future[GenerationResult]:
        """Run `request` on exactly the weights the session is bound to."""
        binding = self.binding(sampler_id)
        slot = self._engines[binding.engine_key]
        if binding.adapter is not None and binding.adapter not in slot.live_adapters:
            raise StaleSnapshotError(
                "sampling_session_id",
                f"sampler '{sampler_id}' was bound to a LoRA snapshot that has been unloaded "
                f"(at most {self.config.max_lora_snapshots} snapshots per model stay live); "
                "get a new sampling client from the training client",
            )
        if binding.version not in (None, 0) and binding.version != slot.version:
            raise StaleSnapshotError(
                "sampling_session_id",
                f"sampler '{sampler_id}' was bound to full-weights snapshot {binding.version}, "
                f"but the model has since synced snapshot {slot.version} (full fine-tuning keeps "
                "one live snapshot per model); get a new sampling client",
            )
        request = replace(request, adapter=binding.adapter)
        return slot.engine.generate_for_session(sampler_id, request)  # a pool routes by session

    def engine(self, sampler_id: str) -> SamplingEngine:
        return self._engines[self.binding(sampler_id).engine_key].engine

    def tokenizer(self, sampler_id: str):
        return self.engine(sampler_id).tokenizer

    def before_training(self, base_model: str) -> None:
        """Training on `base_model` is about to run: colocated engine pools of its models sleep
        until their next request or sync (`SamplingEngine.before_training`)."""
        for slot in list(self._engines.values()):
            if slot.base_model == base_model:
                slot.engine.before_training()

    def shutdown(self) -> None:
        """Shut every engine down (engine pools: kill their actors, free their resources)."""
        for slot in list(self._engines.values()):
            slot.engine.shutdown()
        shutil.rmtree(self._scratch, ignore_errors=True)


def _memory_dir() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None
