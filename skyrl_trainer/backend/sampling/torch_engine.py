"""A sampling engine in plain PyTorch + transformers, for machines without vLLM (e.g. CPU-only).

Dynamic batching, with requests merged into the running batch between decode steps:

- `generate()` validates the request, queues it and returns a Future at once. One background thread
  owns the model and runs the loop; nothing else touches the model or the caches.
- Each loop iteration admits everything waiting (up to `max_batch_size` rows): the new requests'
  prompts are prefilled together (right-padded, one forward per adapter and per `max_batch_tokens`
  of padded prompt), each prompt once however many samples it has, and their rows join the running
  batch. Then every row advances one token in one batched forward (one per adapter in use).
- KV lives in a preallocated slot cache (`kv_cache.SlotKVCache`): each row has its own length, so
  rows that joined at different steps decode together, and a finished row (stop token, stop string,
  max_tokens, context length) leaves the batch at once. Only the last position's logits are computed.
- Sampling (`row_sampling`): per-row temperature/top-k/top-p, one random stream per row (seeded
  from (seed, sample index)), raw-distribution log-probs.

Weight updates, and LoRA changes that affect requests in flight, are queued like requests: the loop
admits what came before them, stops admitting, lets the running rows finish, applies the change, and
goes on; so requests queued before see the old weights and requests queued after the new ones.
LoRA adapters are merged into copies of the weights they adapt (`torch_lora`); rows of different
adapters run in separate groups (own cache, own forward), each on its adapter's weights.

Prefix reuse (`prefix_cache`): a finished row's KV (prompt + generated tokens) is kept in a bounded
LRU store under (adapter, token ids); a request whose prompt starts with a stored sequence (a
multi-turn rollout's next turn) starts its rows from that KV and prefills only the rest of its
prompt. Requests asking for prompt log-probs always prefill their whole prompt. A weight update
drops the whole store, replacing or removing an adapter drops that adapter's entries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from pathlib import Path

import torch

from skyrl_trainer.backend.compute_dtype import resolve_compute_dtype
from skyrl_trainer.backend.model_loading import load_causal_lm, load_tokenizer
from skyrl_trainer.backend.sampling.engine import (
    GenerationRequest,
    GenerationResult,
    validate_request,
)
from skyrl_trainer.backend.sampling.engine_control import EngineControl
from skyrl_trainer.backend.sampling.kv_cache import SLOT_ATTENTION
from skyrl_trainer.backend.sampling.prefix_cache import PrefixStore
from skyrl_trainer.backend.sampling.torch_batch import BatchRunner, EngineStats, RowGroup, fail
from skyrl_trainer.backend.sampling.torch_lora import AdapterSet
from skyrl_trainer.backend.sampling.torch_requests import Pending, plan_prefill
from skyrl_trainer.backend.sampling.weight_table import WeightTable

logger = logging.getLogger(__name__)


class TorchSamplingEngine:
    """A `SamplingEngine` that batches generation over one transformers causal LM."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        max_batch_tokens: int = 8192,
        max_batch_size: int = 128,
        max_model_len: int | None = None,
        admission_window_s: float = 0.002,
        num_threads: int | None = None,
        max_merged_adapters: int = 2,
        prefix_cache_tokens: int = 16384,
    ):
        """Load the model and tokenizer of `model_dir` and start the engine thread.

        - `dtype`/`device`: what the model runs in (device "auto": CUDA if available, else CPU;
          dtype "auto": bf16 where the device computes it natively, else float32).
        - `max_batch_size`: most rows (samples) decoding at once; later requests wait, and join
          as rows finish. A single request bigger than this still runs, alone.
        - `max_batch_tokens`: most padded prompt tokens per prefill forward.
        - `max_model_len`: context length (prompt + generated tokens); default and upper bound:
          the model's `max_position_embeddings` (and its sliding window, if any).
        - `admission_window_s`: when idle, how long to wait after a first request for others
          to arrive, so that a burst starts as one batch.
        - `num_threads`: torch threads of the engine thread (default: the caller's setting).
        - `max_merged_adapters`: LoRA adapters kept merged into weight copies (`torch_lora`).
        - `prefix_cache_tokens`: most tokens of finished rows' KV kept for reuse by prompts that
          extend them (`prefix_cache`; LRU; 0 disables). Each token costs
          layers * 2 * kv_heads * head_dim * dtype bytes (SmolLM2-135M float32: 45 KiB).
        """
        if str(device) == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.dtype = resolve_compute_dtype(dtype, self.device, field="backend.sampling.dtype")
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.admission_window_s = admission_window_s
        # OpenMP thread counts are per thread: the loop thread would not inherit the caller's.
        self.num_threads = num_threads or torch.get_num_threads()
        self.tokenizer = load_tokenizer(model_dir)
        model = load_causal_lm(model_dir, self.dtype).to(self.device)
        model.requires_grad_(False)
        model.set_attn_implementation(SLOT_ATTENTION)
        self.weights = WeightTable(model)
        self.adapters = AdapterSet(model, max_merged=max_merged_adapters)
        config = model.config.get_text_config()
        context = config.max_position_embeddings
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True):
            context = min(context, window)  # masks here are full causal: stay inside the window
        self.max_model_len = min(max_model_len or context, context)
        self.stats = EngineStats()
        self.prefix_store = PrefixStore(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self.runner = BatchRunner(
            self.adapters,
            dtype=self.dtype,
            device=self.device,
            max_model_len=self.max_model_len,
            stats=self.stats,
            prefix_store=self.prefix_store,
        )
        self.vocab_size = self.runner.vocab_size
        self._groups: dict[str | None, RowGroup] = {}
        self._queue: deque[Pending | EngineControl] = deque()
        self._cancelled: set[Future] = set()  # running requests to stop (`cancel`)
        self._cond = threading.Condition()
        self._stopping = False
        self._busy_since: float | None = None
        self._busy_start_stats = EngineStats()
        self._thread = threading.Thread(target=self._run, name="torch-sampling-engine", daemon=True)
        self._thread.start()
        logger.info(
            "sampling engine: PyTorch on %s in %s, up to %d rows at once, context %d",
            self.device,
            str(self.dtype).removeprefix("torch."),
            max_batch_size,
            self.max_model_len,
        )

    @property
    def model(self) -> torch.nn.Module:
        """The Hugging Face model (its adapted layers hold merged weights while an adapter runs)."""
        return self.adapters.model

    # ------------------------------------------------------------------------------------------
    # public API (any thread)

    def generate(self, request: GenerationRequest) -> Future[GenerationResult]:
        future: Future[GenerationResult] = Future()
        try:
            validate_request(request, self.vocab_size, self.max_model_len)
        except Exception as exc:
            with self._cond:
                self.stats.requests_submitted += 1
                self.stats.requests_failed += 1
            future.set_exception(exc)
            return future
        with self._cond:
            self.stats.requests_submitted += 1
            if self._stopping:
                future.set_exception(RuntimeError("the sampling engine is shut down"))
                return future
            self._queue.append(Pending(request, future, self.tokenizer, self.max_model_len))
            self._cond.notify()
        return future

    def generate_for_session(
        self, session: str | None, request: GenerationRequest
    ) -> Future[GenerationResult]:
        return self.generate(request)  # one engine: nothing to route

    def cancel(self, future: Future[GenerationResult]) -> bool:
        """Stop the request `future` (from `generate`) stands for: a queued request leaves the
        queue, a running one's rows leave the batch before the next decode step; the future
        ends cancelled (or with `CancelledError`). False if it had already finished."""
        with self._cond:
            for item in self._queue:
                if isinstance(item, Pending) and item.future is future:
                    self._queue.remove(item)
                    return future.cancel()
            if future.done():
                return False
            self._cancelled.add(future)
            self._cond.notify()
        return True

    def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        plan = self.weights.plan(named_tensors)  # refuses bad names/shapes before any change

        def apply() -> None:
            self.adapters.forget_merged()  # merged copies are of the old base weights
            self._forget_prefixes(None, everything=True)
            self.weights.apply(plan)

        self._control(apply, must_wait=lambda taken: True)

    def add_lora(self, name: str, adapter_dir: str) -> None:
        folder = self.adapters.check_folder(name, adapter_dir)

        # A new name changes nothing in flight; replacing an adapter waits for the rows using it.
        def load() -> None:
            self._forget_prefixes(name)
            self.adapters.load(name, folder)

        self._control(load, must_wait=lambda taken: self._adapter_in_use(name, taken))

    def remove_lora(self, name: str) -> None:
        def remove() -> None:
            self._forget_prefixes(name)
            self.adapters.remove(name)

        self._control(remove, must_wait=lambda taken: self._adapter_in_use(name, taken))

    def before_training(self) -> None:
        pass  # in-process: nothing to free for the trainer

    def sleep(self) -> None:
        pass  # no sleep mode: the weights stay where they are

    def wake_up(self) -> None:
        pass

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _control(self, fn: Callable[[], object], must_wait: Callable[[list], bool]) -> None:
        control = EngineControl(fn, must_wait)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the sampling engine is shut down")
            self._queue.append(control)
            self._cond.notify()
        control.future.result()

    # ------------------------------------------------------------------------------------------
    # the loop (engine thread only)

    def _run(self) -> None:
        torch.set_num_threads(self.num_threads)
        try:
            with torch.inference_mode():
                while (items := self._next_items()) is not None:
                    if self._busy_since is None:
                        self._busy_since = time.perf_counter()
                        self._busy_start_stats = EngineStats(**vars(self.stats))
                    self._process(items)
                    self._drop_cancelled()
                    for group in list(self._groups.values()):
                        self._guarded(group, self.runner.decode)
                    self._note_progress()
        except BaseException:
            logger.exception("the sampling engine loop died")
            raise
        finally:
            self._fail_all(RuntimeError("the sampling engine is shut down"))

    def _drop_cancelled(self) -> None:
        """Rows of requests cancelled while running leave the batch (and their KV slots)."""
        with self._cond:
            if not self._cancelled:
                return
            cancelled, self._cancelled = self._cancelled, set()
        for group in list(self._groups.values()):
            drop = [i for i, row in enumerate(group.rows) if row.pending.future in cancelled]
            if not drop:
                continue
            for i in drop:
                fail(group.rows[i].pending, CancelledError("cancelled"), self.stats)
            order = group.cache.remove_rows(drop)
            group.rows = [group.rows[j] for j in order]
            group.settings = None
            if not group.rows:
                self._groups.pop(group.adapter, None)

    def _forget_prefixes(self, adapter: str | None, everything: bool = False) -> None:
        """Weights are about to change: drop the stored KV computed with them."""
        if self.prefix_store is not None:
            if everything:
                self.prefix_store.clear()
            else:
                self.prefix_store.drop_adapter(adapter)

    def _adapter_in_use(self, name: str, taken: list) -> bool:
        return name in self._groups or any(
            isinstance(item, Pending) and item.request.adapter == name for item in taken
        )

    def _num_rows(self) -> int:
        return sum(len(g.rows) for g in self._groups.values())

    def _next_items(self) -> list[Pending | EngineControl] | None:
        """What to admit this iteration; waits while idle. None: shut down."""
        with self._cond:
            idle = self._num_rows() == 0
            while not self._stopping and not self._queue and idle:
                self._cond.wait()
            if self._stopping:
                return None
        if idle and self.admission_window_s > 0:
            time.sleep(self.admission_window_s)  # let a burst of concurrent requests gather
        with self._cond:
            if self._stopping:
                return None
            items: list[Pending | EngineControl] = []
            rows = self._num_rows()
            while self._queue:
                item = self._queue[0]
                if isinstance(item, EngineControl):
                    if (rows or items) and item.must_wait(items):
                        break
                elif rows and rows + item.num_rows > self.max_batch_size:
                    break
                else:
                    rows += item.num_rows
                items.append(self._queue.popleft())
            return items

    def _process(self, items: list[Pending | EngineControl]) -> None:
        """Admit requests and run controls, in queue order."""
        batch: list[Pending] = []
        for item in items:
            if isinstance(item, EngineControl):
                self._admit(batch)
                batch = []
                self._run_control(item)
            else:
                batch.append(item)
        self._admit(batch)

    def _run_control(self, control: EngineControl) -> None:
        # Weight copies need tensors outside inference mode (they outlive this step).
        with torch.inference_mode(False), torch.no_grad():
            control.run()

    def _admit(self, pendings: list[Pending]) -> None:
        by_adapter: dict[str | None, list[Pending]] = {}
        for pending in pendings:
            if not pending.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            adapter = pending.request.adapter
            if adapter is not None and adapter not in self.adapters:
                fail(pending, self.adapters.unknown(adapter), self.stats)
                continue
            by_adapter.setdefault(adapter, []).append(pending)
        for adapter, group_pendings in by_adapter.items():
            group = self._groups.get(adapter)
            if group is None:
                group = self._groups[adapter] = self.runner.new_group(adapter)
            fresh, reused, matches = self._match_prefixes(adapter, group_pendings)
            for chunk in self._prefill_chunks(fresh, [p.prompt_len for p in fresh]):
                self._guarded(group, lambda g, chunk=chunk: self.runner.prefill(g, chunk), chunk)
            suffix_lens = [p.prompt_len - m.length for p, m in zip(reused, matches)]
            for idx in plan_prefill(suffix_lens, self.max_batch_tokens):
                chunk, chunk_matches = [reused[i] for i in idx], [matches[i] for i in idx]
                self._guarded(
                    group,
                    lambda g, c=chunk, m=chunk_matches: self.runner.prefill(g, c, m),
                    chunk,
                )

    def _match_prefixes(self, adapter: str | None, pendings: list[Pending]):
        """Split `pendings` into those to prefill in full and those starting from stored KV
        (with their matches)."""
        store = self.prefix_store
        fresh, reused, matches = [], [], []
        for pending in pendings:
            match = None
            if store is not None and not pending.wants_prompt_logprobs and pending.num_rows:
                match = store.lookup(adapter, pending.request.prompt_ids)
            if match is None:
                fresh.append(pending)
            else:
                reused.append(pending)
                matches.append(match)
        return fresh, reused, matches

    def _prefill_chunks(self, pendings: list[Pending], lengths: list[int]) -> list[list[Pending]]:
        return [
            [pendings[i] for i in chunk] for chunk in plan_prefill(lengths, self.max_batch_tokens)
        ]

    def _guarded(self, group: RowGroup, step: Callable, pendings: list[Pending] = ()) -> None:
        """Run a step of `group`; if it raises, fail its requests (and `pendings`), not the loop."""
        try:
            step(group)
        except Exception as exc:
            logger.exception("sampling step failed; failing the requests it served")
            affected = {id(p): p for p in [*(r.pending for r in group.rows), *pendings]}
            for pending in affected.values():
                fail(pending, exc, self.stats)
            self._groups.pop(group.adapter, None)
        else:
            if not group.rows:
                self._groups.pop(group.adapter, None)

    # -- forwards ------------------------------------------------------------------------------

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._stopping = True
            queued = list(self._queue)
            self._queue.clear()
        for group in self._groups.values():
            for row in group.rows:
                fail(row.pending, exc, self.stats)
        self._groups.clear()
        for item in queued:
            if isinstance(item, EngineControl):
                item.future.set_exception(exc)
            else:
                fail(item, exc, self.stats)

    def _note_progress(self) -> None:
        """A debug line per batch: from the engine turning busy until it is idle again."""
        if not self._groups and self._busy_since is not None:
            now = time.perf_counter()
            before, after = self._busy_start_stats, self.stats
            tokens = after.generated_tokens - before.generated_tokens
            seconds = max(now - self._busy_since, 1e-9)
            logger.debug(
                "batch: %d requests, max %d rows, %d prompt + %d generated tokens, "
                "%d prefill + %d decode forwards, %.2f s, %.1f tok/s",
                after.requests_completed - before.requests_completed,
                after.max_rows,
                after.prompt_tokens - before.prompt_tokens,
                tokens,
                after.prefill_forwards - before.prefill_forwards,
                after.decode_forwards - before.decode_forwards,
                seconds,
                tokens / seconds,
            )
            self._busy_since = None
