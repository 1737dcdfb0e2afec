"""Several sampling engine replicas, each in a Ray actor, behind the `SamplingEngine` interface.

`sampling.num_engines > 1` gives every served model an `EnginePool` instead of one in-process
engine; the registry and the core cannot tell them apart. What the pool promises:

- routing: a request goes to one live engine, chosen by rendezvous hashing of (sampler session,
  first `affinity_prefix_tokens` prompt tokens), so a session's repeated prompt prefix lands on the
  engine that has it cached; the least loaded engine takes it instead when the chosen one has
  `max_batch_size` more rows in flight. Replicas are identical (same weights, same seed handling,
  same threads), so a seeded request gives the same tokens whichever engine serves it, exactly as
  far as one engine's results do not depend on what else shares its batch: float rounding from
  batch composition (~1e-6 in float32 log-probs) can move an inverse-CDF sample to a neighbouring
  token on near-uniform distributions; each request alone (max_batch_size <= num_samples) is exact.
  Results are concurrent Futures, like the in-process engines'.
- cancelling: `cancel(future)` stops a request of `generate*`: the future ends cancelled at once,
  and its engine drops it (`ray_engine.EngineActor.cancel_request`): a request still waiting for
  its turn on the actor is never queued, one in the engine leaves its queue or its batch before the
  next decode step; its rows stop counting as load when the engine has let it go. False if it had
  already finished.
- syncs: `update_weights`, `add_lora` and `remove_lora` reach every live engine before they return,
  so any engine can serve any session. Full weights are put once in the Ray object store
  (`ray.put`, on CPU in the sampling dtype) and each actor loads them from there; or, with
  `sampling.weight_sync: broadcast`, sent through a process group of the pool and its engines
  (`weight_broadcast`: gloo on CPU, NCCL when the engines hold GPUs; the group is formed on first
  use and again, with the live engines, after a failure). Adapters travel as the bytes of the
  PEFT folder (no shared storage).
- ordering: each actor applies calls in the order the pool issued them (`ray_engine`): a request
  issued before a sync is served by the old weights, one issued after by the new.
- failure: an engine actor that dies fails its requests with `EngineDiedError` naming the engine
  index, its actor id and Ray's reason, as soon as Ray reports the death (no hang); later requests
  and syncs use the live engines only, and with none left everything fails at once. An engine that
  fails a sync other engines applied is killed (it would serve other weights). A hung but live
  engine is not detected.
- colocated placement: `before_training()` puts the engines to sleep (vLLM sleep mode) until their
  next request or sync. On CPU this changes nothing; the GPU path is untested.
- `shutdown()` kills the actors and removes their placement group.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import remove_placement_group

from skyrl_trainer.backend.compute_dtype import resolve_compute_dtype
from skyrl_trainer.backend.config import RayConfig, SamplingConfig
from skyrl_trainer.backend.distributed import ray_cluster
from skyrl_trainer.backend.distributed.actor_errors import brief, cause_of
from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.model_loading import load_tokenizer
from skyrl_trainer.backend.sampling.engine import (
    EngineDiedError,
    GenerationRequest,
    GenerationResult,
    validate_request,
)
from skyrl_trainer.backend.sampling.engine_launch import check_config, engine_bundle, launch
from skyrl_trainer.backend.sampling.torch_lora import AdapterSet
from skyrl_trainer.backend.sampling.weight_broadcast import WeightSender, pack, plan_buckets

__all__ = ["EngineDiedError", "EnginePool"]

logger = logging.getLogger(__name__)


class EnginePool:
    """`config.num_engines` engine actors serving one model (see the module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        config: SamplingConfig,
        lora: bool = False,
        ray_config: RayConfig | None = None,
    ):
        check_config(config)  # before anything starts
        self.config, self.model_dir, n = config, Path(model_dir), config.num_engines
        self._lock = threading.Lock()  # loads, deaths
        self._submit_lock = threading.Lock()  # sequence numbers: issue order = turn order
        self._seqs = [0] * n
        self._loads = [0] * n  # rows (samples) in flight per engine
        self._in_flight: dict[Future, tuple[int, int]] = {}  # unfinished future -> (engine, seq)
        self.requests_per_engine = [0] * n
        self._dead: dict[int, str] = {}
        self._sync_lock = threading.Lock()  # broadcast updates share one process group
        ray_cluster.connect(ray_config or RayConfig())  # before asking Ray about GPUs
        on_gpu = bool(engine_bundle(config).get("GPU")) and torch.cuda.is_available()
        # The dtype weights travel in; "auto" resolves as the engines will on their device.
        self._dtype = resolve_compute_dtype(
            config.dtype, "cuda" if on_gpu else "cpu", field="backend.sampling.dtype"
        )
        self._sender = WeightSender("nccl" if on_gpu else "gloo", config.weight_sync_timeout_s)
        self.tokenizer = load_tokenizer(model_dir)
        launched = launch(self.model_dir, config, lora)
        self._pg = launched.placement_group
        self._actors, self._actor_ids = launched.actors, launched.actor_ids
        self.vocab_size = launched.described[0]["vocab_size"]
        self.max_model_len = launched.described[0]["max_model_len"]
        self.pids = [d["pid"] for d in launched.described]
        logger.info("%d sampling engines for %s: actors %s", n, self.model_dir, self._actor_ids)

    # ----- engines ------------------------------------------------------------------------

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)

    @property
    def actor_ids(self) -> list[str]:
        return list(self._actor_ids)

    @property
    def dead_engines(self) -> dict[int, str]:
        """Engine index -> why it is out of service."""
        with self._lock:
            return dict(self._dead)

    def _name(self, index: int) -> str:
        return f"sampling engine {index} (actor {self._actor_ids[index]})"

    def _mark_dead(self, index: int, why: str, log: bool = True) -> str:
        with self._lock:
            if index not in self._dead:
                self._dead[index] = f"{self._name(index)} {why}"
                if log:
                    logger.error(self._dead[index])
            return self._dead[index]

    def _kill(self, index: int, why: str, log: bool = True) -> None:
        self._mark_dead(index, why, log)
        with contextlib.suppress(Exception):
            ray.kill(self._actors[index], no_restart=True)

    def _live(self) -> list[int]:
        with self._lock:
            live = [i for i in range(len(self._actors)) if i not in self._dead]
            if not live:
                reasons = "; ".join(self._dead[i] for i in sorted(self._dead)) or "shut down"
                raise EngineDiedError(f"no sampling engine of {self.model_dir} is left: {reasons}")
            return live

    def _submit(self, index: int, method: str, *args: Any) -> ray.ObjectRef:
        return self._submit_numbered(index, method, *args)[0]

    def _submit_numbered(self, index: int, method: str, *args: Any) -> tuple[ray.ObjectRef, int]:
        """Call `method` on engine `index` with the next turn number; the ref and that number."""
        with self._submit_lock:
            seq = self._seqs[index]
            self._seqs[index] += 1
            actor = self._actors[index]
            try:
                return getattr(actor, method).remote(seq, *args), seq
            except BaseException:
                actor.skip.remote(seq)  # the actor must not wait for this turn
                raise

    # ----- generation ---------------------------------------------------------------------

    def route(self, session: str | None, request: GenerationRequest) -> int:
        """The engine index that would serve `request` for `session` now."""
        live = self._live()
        prefix = request.prompt_ids[: self.config.affinity_prefix_tokens]
        key = f"{session or ''}|{','.join(map(str, prefix))}".encode()

        def score(index: int) -> int:
            digest = hashlib.blake2b(key + b"#%d" % index, digest_size=8).digest()
            return int.from_bytes(digest, "little")

        preferred = max(live, key=score)
        with self._lock:
            least = min(live, key=self._loads.__getitem__)
            if self._loads[preferred] - self._loads[least] >= self.config.max_batch_size:
                return least
        return preferred

    def generate(self, request: GenerationRequest) -> Future[GenerationResult]:
        return self.generate_for_session(None, request)

    def generate_for_session(
        self, session: str | None, request: GenerationRequest
    ) -> Future[GenerationResult]:
        """Queue `request` on the engine `route(session, request)` picks."""
        try:
            validate_request(request, self.vocab_size, self.max_model_len)
            index = self.route(session, request)
        except Exception as exc:
            future: Future[GenerationResult] = Future()
            future.set_exception(exc)
            return future
        return self.generate_on(index, request)

    def generate_on(self, index: int, request: GenerationRequest) -> Future[GenerationResult]:
        """Queue `request` on engine `index` itself (no routing; for tests and debugging)."""
        out: Future[GenerationResult] = Future()
        rows = request.num_samples
        with self._lock:
            dead = self._dead.get(index)
            if dead is None:
                self._loads[index] += rows
                self.requests_per_engine[index] += 1
        if dead is not None:
            out.set_exception(EngineDiedError(dead))
            return out

        def done(ref_future: Future) -> None:
            with self._lock:
                self._loads[index] -= rows
                self._in_flight.pop(out, None)
            if out.cancelled():
                return  # a cancelled request's actor call returns None
            with contextlib.suppress(InvalidStateError):  # cancelled since the check above
                try:
                    result = ref_future.result()
                except ray.exceptions.RayActorError as exc:
                    why = self._mark_dead(index, f"died: {brief(exc)}")
                    out.set_exception(EngineDiedError(f"{why} (this request was on it)"))
                except BaseException as exc:
                    out.set_exception(cause_of(exc))
                else:
                    out.set_result(result)

        ref, seq = self._submit_numbered(index, "generate", request)
        with self._lock:
            self._in_flight[out] = (index, seq)  # before `done` can run, which forgets it
        ref.future().add_done_callback(done)
        return out

    def cancel(self, future: Future[GenerationResult]) -> bool:
        """Stop the request `future` (from `generate*`) stands for (see the module docstring):
        the future is cancelled at once, the engine lets the request go soon after. False if it
        had already finished."""
        if not future.cancel():
            return False
        with self._lock:
            where = self._in_flight.pop(future, None)  # None: cancelled before, or finishing
        if where is not None:
            index, seq = where
            # Not numbered: it must overtake the generate call waiting for its turn or its result.
            with contextlib.suppress(Exception):  # a dead engine drops its requests anyway
                self._actors[index].cancel_request.remote(seq)
        return True

    # ----- syncs --------------------------------------------------------------------------

    def _broadcast(self, method: str, *args: Any) -> None:
        """Run `method` on every live engine; return when all have applied it."""
        self._collect(method, {i: self._submit(i, method, *args) for i in self._live()})

    def _collect(
        self, method: str, refs: dict[int, ray.ObjectRef], unchanged_on_error: bool = False
    ) -> None:
        """Wait for `method` on the engines of `refs`. Engines that died are marked dead; engines
        that failed it while others applied it are killed (they would serve other weights). If
        none applied it, the first error is raised; the engines that failed are killed too unless
        a failure is known to change nothing (a refused request, or `unchanged_on_error`)."""
        applied, errors = [], {}
        for index, ref in refs.items():
            try:
                ray.get(ref)
                applied.append(index)
            except ray.exceptions.RayActorError as exc:
                self._mark_dead(index, f"died during {method}: {brief(exc)}")
            except ray.exceptions.RayError as exc:
                errors[index] = cause_of(exc)
        if errors:
            first = errors[min(errors)]
            unchanged = unchanged_on_error or all(
                isinstance(e, InvalidRequestError) for e in errors.values()
            )
            if not applied and unchanged:
                raise first  # no engine changed
            for index, exc in errors.items():
                self._kill(index, f"was killed: it failed {method} ({brief(exc)})")
            if not applied:
                raise first
        if not applied:
            self._live()  # raises: every engine is dead

    def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        if not isinstance(named_tensors, Mapping):
            raise InvalidRequestError(
                "named_tensors", f"is a {type(named_tensors).__name__}, not a name -> tensor dict"
            )
        if self.config.weight_sync == "broadcast":
            self._update_by_broadcast(named_tensors)
            return
        tensors = {
            name: t.detach().to(device="cpu", dtype=self._dtype)
            if isinstance(t, torch.Tensor) and t.is_floating_point()
            else t
            for name, t in named_tensors.items()
        }
        ref = ray.put(tensors)  # once; every actor reads it from the object store
        del tensors
        self._broadcast("update_weights", ref)

    def _update_by_broadcast(self, tensors: Mapping[str, Any]) -> None:
        """Pack `tensors` (cast to the sampling dtype on the way) and broadcast them."""
        for name, tensor in tensors.items():
            if not (isinstance(tensor, torch.Tensor) and tensor.is_floating_point()):
                raise InvalidRequestError(
                    f"named_tensors[{name!r}]", "is not a floating-point tensor"
                )
        with self._sync_lock:
            live = self._live()
            if self._sender.members != live or self._sender.group is None:
                self._form_weight_group(live)
            shapes = {n: tuple(t.shape) for n, t in tensors.items()}
            slots, sizes = plan_buckets(shapes, self._dtype.itemsize)
            device = "cuda" if self._sender.backend == "nccl" else "cpu"
            buckets = pack(tensors, slots, sizes, self._dtype, device)
            refs = {
                i: self._submit(i, "receive_weights", slots, sizes, self._dtype)
                for i in self._sender.members
            }
            try:
                self._sender.send(buckets)
            except Exception as exc:  # the engines' side says which one failed and why
                logger.warning("weight broadcast failed: %s", exc)
            # A failed receive happens before the engine applies anything.
            self._collect("update_weights", refs, unchanged_on_error=True)

    def _form_weight_group(self, live: list[int]) -> None:
        """A new process group of this process (rank 0) and the engines `live`."""
        host, port = ray_cluster.rendezvous_address()
        world = len(live) + 1
        refs = {
            i: self._submit(
                i,
                "join_weight_group",
                host,
                port,
                rank,
                world,
                self._sender.backend,
                self.config.weight_sync_timeout_s,
            )
            for rank, i in enumerate(live, start=1)
        }
        try:
            self._sender.form(live, host, port)
        except Exception as exc:
            self._collect("join_weight_group", refs, unchanged_on_error=True)  # names who failed
            raise EngineDiedError(f"forming the weight broadcast group failed: {exc}") from exc
        self._collect("join_weight_group", refs, unchanged_on_error=True)

    def add_lora(self, name: str, adapter_dir: str) -> None:
        folder = AdapterSet.check_folder(name, adapter_dir)
        files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
        self._broadcast("add_lora", name, ray.put(files))

    def remove_lora(self, name: str) -> None:
        self._broadcast("remove_lora", name)

    def before_training(self) -> None:
        """Colocated engines: sleep (after their requests in flight) until the next request or
        sync wakes them. Separate engines: nothing."""
        if self.config.engine_placement == "colocated":
            self.sleep()

    def sleep(self) -> None:
        """Every engine sleeps (after its requests in flight) until its next request or sync."""
        self._broadcast("sleep")

    def wake_up(self) -> None:
        pass  # each engine wakes on its next request or sync

    def engine_stats(self) -> list[dict | None]:
        """Each engine's counters (None for a dead one)."""
        out = []
        for actor in self._actors:
            try:
                out.append(ray.get(actor.stats.remote(), timeout=30))
            except ray.exceptions.RayError:
                out.append(None)
        return out

    def shutdown(self) -> None:
        """Kill the engine actors and free their placement group (idempotent)."""
        for index in range(len(self._actors)):
            self._kill(index, "was shut down", log=False)
        if self._pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
            self._pg = None
