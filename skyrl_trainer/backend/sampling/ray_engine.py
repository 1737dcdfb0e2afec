"""One sampling engine replica inside a Ray actor: the actor side of `engine_pool.EnginePool`.

What it promises:
- It builds the engine `sampling.engine` names exactly as the in-process path does
  (`engine_factory.make_engine`, same seed handling), so replicas given the same weights return
  the same tokens for the same seeded request.
- Calls take effect in the order the pool numbered them (`seq`), whatever order Ray runs them in
  (an async actor runs its calls concurrently and keeps no order): a request numbered before a
  weight update is queued in the engine before it, so it is served by the old weights; anything
  numbered after an update, adapter change or sleep waits until that has been applied.
- Weights arrive as tensors (Ray resolves the object-store reference) or, with
  `sampling.weight_sync: broadcast`, through the pool's process group (`weight_broadcast`);
  adapters as the bytes of a PEFT folder's files, written to a scratch folder of this actor's
  node, so no storage is shared.
- `sleep` (colocated engines) uses the engine's own sleep mode where it has one (vLLM on GPU);
  the next request or sync wakes it first. The PyTorch engine has none: it only records the state.
- Every result says which engine served it (`GenerationResult.extra["engine"]`).
- `cancel_request(seq)` (not numbered: it must run while calls wait for their turn) stops the
  `generate` numbered `seq`: one in the engine is cancelled there (`engine.cancel`: a queued request
  leaves the engine's queue, a running one's rows leave its batch), one that has not had its turn
  takes it without queuing anything (later calls must not wait for a turn never taken), a finished
  one is left alone. A cancelled `generate` returns None.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from concurrent.futures import Future
from pathlib import Path

import torch

from skyrl_trainer.backend.config import SamplingConfig
from skyrl_trainer.backend.sampling.engine import GenerationRequest, GenerationResult
from skyrl_trainer.backend.sampling.engine_factory import make_engine
from skyrl_trainer.backend.sampling.weight_broadcast import TensorSlot, WeightReceiver


class EngineActor:
    """A sampling engine and the turn-taking that keeps the pool's call order."""

    def __init__(
        self, model_dir: str, config: SamplingConfig, lora: bool, index: int, sleep_mode: bool
    ):
        # The PyTorch engine takes the caller's thread count: one per reserved CPU.
        torch.set_num_threads(max(1, int(config.num_cpus_per_engine)))
        self.index = index
        self.engine = make_engine(Path(model_dir), config, lora=lora, sleep_mode=sleep_mode)
        self._next_seq = 0
        self._turns = asyncio.Condition()
        self._in_engine: dict[int, Future] = {}  # seq -> engine future of a generate in flight
        self._cancelled: set[int] = set()  # seqs `cancel_request` stopped, until generate sees it
        self._asleep = False
        self._counts = {
            "requests": 0,  # generate calls that reached the engine
            "weight_updates": 0,
            "adapter_loads": 0,
            "sleeps": 0,
            "cancelled_in_engine": 0,
            "cancelled_before_turn": 0,
        }
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._scratch = Path(tempfile.mkdtemp(prefix=f"skyrl-engine{index}-", dir=shm))
        self._receiver = WeightReceiver()

    def describe(self) -> dict:
        return {
            "vocab_size": int(self.engine.vocab_size),
            "max_model_len": int(self.engine.max_model_len),
            "pid": os.getpid(),
        }

    def stats(self) -> dict:
        out = {**self._counts, "asleep": self._asleep}
        engine_stats = getattr(self.engine, "stats", None)  # the PyTorch engine counts tokens
        if engine_stats is not None:
            out["generated_tokens"] = engine_stats.generated_tokens
        return out

    @contextlib.asynccontextmanager
    async def _turn(self, seq: int):
        """Run the body when every call numbered before `seq` has taken its turn."""
        async with self._turns:
            await self._turns.wait_for(lambda: self._next_seq == seq)
        try:
            yield
        finally:
            async with self._turns:
                self._next_seq += 1
                self._turns.notify_all()

    async def _wake(self) -> None:
        if self._asleep:
            await asyncio.to_thread(self.engine.wake_up)
            self._asleep = False

    async def generate(self, seq: int, request: GenerationRequest) -> GenerationResult | None:
        """The engine's result, or None when `cancel_request(seq)` stopped it."""
        async with self._turn(seq):
            await self._wake()
            if seq in self._cancelled:  # cancelled before its turn: the turn passes, no request
                self._cancelled.discard(seq)
                return None
            future = self.engine.generate(request)  # queued in the engine in turn order
            self._in_engine[seq] = future
            self._counts["requests"] += 1
        try:
            result = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # asyncio turns the engine future's cancellation into this; a cancellation of the
            # call itself (not ours) goes on up.
            if seq in self._cancelled:
                return None
            raise
        finally:
            self._in_engine.pop(seq, None)
            self._cancelled.discard(seq)
        result.extra["engine"] = self.index
        return result

    async def cancel_request(self, seq: int) -> None:
        """Stop the `generate` numbered `seq` (see the module docstring). Async, so it runs on
        the event loop between `generate`'s steps and sees its state as it is."""
        future = self._in_engine.get(seq)
        if future is not None:
            self._cancelled.add(seq)
            # An engine without `cancel` can only drop a request still in its queue. False: it
            # finished meanwhile, and generate returns its result (the pool ignores it).
            stop = getattr(self.engine, "cancel", None) or (lambda f: f.cancel())
            if stop(future):
                self._counts["cancelled_in_engine"] += 1
        elif seq >= self._next_seq:  # its turn is still to come (or under way, before queuing)
            self._cancelled.add(seq)
            self._counts["cancelled_before_turn"] += 1
        # else: it finished; nothing to stop

    async def update_weights(self, seq: int, named_tensors: dict[str, torch.Tensor]) -> None:
        async with self._turn(seq):
            await self._wake()
            await asyncio.to_thread(self.engine.update_weights, named_tensors)
            self._counts["weight_updates"] += 1

    async def join_weight_group(
        self, seq: int, host: str, port: int, rank: int, world: int, backend: str, timeout_s: float
    ) -> None:
        async with self._turn(seq):
            await asyncio.to_thread(
                self._receiver.join, host, port, rank, world, backend, timeout_s
            )

    async def receive_weights(
        self, seq: int, slots: list[TensorSlot], sizes: list[int], dtype: torch.dtype
    ) -> None:
        """Take part in the pool's broadcast of an update, then apply it (`weight_broadcast`)."""
        async with self._turn(seq):
            await self._wake()
            tensors = await asyncio.to_thread(self._receiver.receive, slots, sizes, dtype)
            await asyncio.to_thread(self.engine.update_weights, tensors)
            self._counts["weight_updates"] += 1

    async def add_lora(self, seq: int, name: str, files: dict[str, bytes]) -> None:
        async with self._turn(seq):  # first thing: a failure must not skip the turn
            folder = Path(tempfile.mkdtemp(dir=self._scratch))
            try:
                for file_name, data in files.items():
                    (folder / file_name).write_bytes(data)
                await self._wake()
                # Both engines have read (or copied) the folder when add_lora returns.
                await asyncio.to_thread(self.engine.add_lora, name, str(folder))
                self._counts["adapter_loads"] += 1
            finally:
                shutil.rmtree(folder, ignore_errors=True)

    async def remove_lora(self, seq: int, name: str) -> None:
        async with self._turn(seq):
            await asyncio.to_thread(self.engine.remove_lora, name)

    async def sleep(self, seq: int) -> None:
        async with self._turn(seq):
            if not self._asleep:
                await asyncio.to_thread(self.engine.sleep)  # after the requests in flight
                self._asleep = True
                self._counts["sleeps"] += 1

    async def skip(self, seq: int) -> None:
        """Take turn `seq` doing nothing (the pool numbered a call it could not send)."""
        async with self._turn(seq):
            pass

    def shutdown(self) -> None:
        self.engine.shutdown()
        shutil.rmtree(self._scratch, ignore_errors=True)
