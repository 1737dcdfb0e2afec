"""A training worker group of N Ray actors behind the `TrainingWorkerGroup` interface.

What it promises (the core and the clients cannot tell it from one in-process worker):
- `forward_backward` splits the examples across the ranks by token count, returns the
  per-datum log-probs in the original order and the summed loss; gradients are summed over
  ranks (Tinker's loss is a SUM over tokens and datums), so after `optim_step` the weights
  and the `grad_norm` metric equal one process's up to float rounding. A failed request
  changes no rank's gradients. `backward=False` does no gradient work.
- checkpoints (`save_state`, `save_sampler_weights`) have the single-process format, and a
  checkpoint from either loads into the other.
- start-up either succeeds or fails in bounded time with a message naming the config field
  (`training.num_workers`, `training.num_cpus_per_worker`, `training.ray.address`, ...).
- a worker that dies (or a collective that breaks) makes the current call raise
  `WorkerGroupError` naming the rank, its actor id and the cause; the surviving workers are
  killed (one waiting in a collective could otherwise wait for its dead peer) and every later
  call fails at once with the same message. The run resumes from its last checkpoint in a new
  process. Waits are bounded: Ray reports a dead actor at once, and a rank stuck in a
  collective gives up after `training.collective_timeout_s`.

The actors (`replica.TrainingReplica`) sit in one placement group (one bundle per worker,
`training.placement_strategy`) and form a torch.distributed group whose rendezvous is rank 0's
node address and a free port there.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tinker import types

from skyrl_trainer.backend import lora as lora_lib
from skyrl_trainer.backend.config import TrainingConfig
from skyrl_trainer.backend.datums import TrainingExample
from skyrl_trainer.backend.distributed import ray_cluster
from skyrl_trainer.backend.distributed.actor_errors import brief, cause_of
from skyrl_trainer.backend.distributed.partition import partition_by_tokens
from skyrl_trainer.backend.distributed.replica import TrainingReplica
from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.losses import LossSpec
from skyrl_trainer.backend.micro_batches import plan_micro_batches
from skyrl_trainer.backend.training_worker import ForwardResult, ModelDescription
from skyrl_trainer.typed_config import ConfigError

logger = logging.getLogger(__name__)

#: Seconds allowed beyond `collective_timeout_s` for survivors to report a broken collective.
COLLECTIVE_GRACE_S = 10.0

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

_ReplicaActor = ray.remote(max_restarts=0, max_task_retries=0)(TrainingReplica)


class WorkerGroupError(RuntimeError):
    """A training worker died or the group broke; the group refuses every later call."""


def _check_config(config: TrainingConfig) -> None:
    if isinstance(config.num_workers, bool) or config.num_workers < 1:
        raise ConfigError(f"training.num_workers: must be >= 1, got {config.num_workers!r}")
    if not config.num_cpus_per_worker > 0:
        raise ConfigError(
            f"training.num_cpus_per_worker: must be > 0, got {config.num_cpus_per_worker!r}"
        )
    if config.num_gpus_per_worker is not None and config.num_gpus_per_worker < 0:
        raise ConfigError("training.num_gpus_per_worker: must be >= 0 (or null for automatic)")
    if config.placement_strategy not in PLACEMENT_STRATEGIES:
        raise ConfigError(
            f"training.placement_strategy: {config.placement_strategy!r} is not one of "
            f"{', '.join(PLACEMENT_STRATEGIES)}"
        )
    for name in ("startup_timeout_s", "collective_timeout_s"):
        if not getattr(config, name) > 0:
            raise ConfigError(f"training.{name}: must be > 0 seconds")


class RayTrainingWorkerGroup:
    """`num_workers` Ray actors training the models on one base model. Calls arrive one at a time."""

    description: ModelDescription

    def __init__(self, model_dir: str | Path, config: TrainingConfig):
        _check_config(config)
        self.config = config
        self.model_dir = Path(model_dir)
        self._actors: list[Any] = []
        self._actor_ids: list[str] = []
        self._pg = None
        self._failure: str | None = None
        self._models: set[str] = set()
        self._sharded: set[str] = set()  # model ids whose weights are FSDP2-sharded
        self._started = False
        ray_cluster.connect(config.ray)
        bundle = ray_cluster.worker_bundle(config)
        if 0 < bundle.get("GPU", 0) < 1:
            raise ConfigError(
                f"training.num_gpus_per_worker: is {bundle['GPU']:g}; CUDA workers need a whole "
                "GPU each (NCCL refuses two ranks on one device)"
            )
        ray_cluster.check_cluster_size(
            config.num_workers,
            bundle,
            "training.num_workers",
            {"CPU": "training.num_cpus_per_worker", "GPU": "training.num_gpus_per_worker"},
            config.startup_timeout_s,
        )
        try:
            self._start(bundle)
        except BaseException:
            self.shutdown()
            raise
        self._started = True

    def _start(self, bundle: dict[str, float]) -> None:
        config, n = self.config, self.config.num_workers
        deadline = time.monotonic() + config.startup_timeout_s
        self._pg = placement_group([dict(bundle)] * n, strategy=config.placement_strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=config.startup_timeout_s)
        if not ready:
            raise ConfigError(
                f"training.num_workers: no room for {n} workers x {bundle} "
                f"({config.placement_strategy}) in the Ray cluster within "
                f"training.startup_timeout_s={config.startup_timeout_s:g} s (available now: "
                f"{ray.available_resources()}). Lower training.num_workers, "
                "training.num_cpus_per_worker or training.num_gpus_per_worker, or free resources."
            )
        for rank in range(n):
            actor = _ReplicaActor.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=rank
                ),
            ).remote(str(self.model_dir), config, rank, n)
            self._actors.append(actor)
            self._actor_ids.append(actor._actor_id.hex())
        address, port = self._call_rank0("rendezvous_address", deadline=deadline)
        args = (address, port, config.collective_timeout_s)
        self._call("init_process_group", [args] * n, fatal=True, deadline=deadline)
        self.description = self._call_rank0("model_description", deadline=deadline)
        self._micro_batch_budget = self._call_rank0("micro_batch_budget", deadline=deadline)
        logger.info("%d training workers for %s: actors %s", n, self.model_dir, self._actor_ids)

    # ----- calling the ranks --------------------------------------------------------------

    @property
    def actors(self) -> list[Any]:
        """The worker actors, by rank (for tests and debugging)."""
        return list(self._actors)

    def _worker(self, rank: int) -> str:
        return f"training worker rank {rank} (actor {self._actor_ids[rank]})"

    def _fail(self, message: str) -> None:
        """Mark the group broken, kill what is left of it, and raise."""
        if self._started:
            message += (
                f". The training worker group for {self.model_dir} is shut down and refuses "
                "further calls; resume from the last checkpoint in a new process."
            )
        else:
            message = f"the training workers for {self.model_dir} failed to start: {message}"
        self._failure = message
        logger.error(self._failure)
        self.shutdown()
        raise WorkerGroupError(self._failure)

    def _call(
        self,
        method: str,
        args_per_rank: list[tuple],
        *,
        fatal: bool,
        deadline: float | None = None,
        actors: list[Any] | None = None,
    ) -> list[Any]:
        """Run `method` on every rank with its arguments; the ranks' results.

        An actor that dies, or any error when `fatal` (the ranks may now disagree, or wait in a
        collective), breaks the group. Otherwise a worker's error is re-raised as it is; so is an
        `InvalidRequestError` that every rank raised (a refusal before any change). Waits end at
        `deadline`, and `collective_timeout_s` (+ grace) after the first error. `actors`: a
        subset of the ranks (from rank 0), default all.
        """
        self._check_usable()
        refs = [
            getattr(actor, method).remote(*args)
            for actor, args in zip(actors or self._actors, args_per_rank, strict=True)
        ]
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        errors: dict[int, BaseException] = {}
        pending, grace_until = list(refs), None
        while pending:
            limits = [t for t in (deadline, grace_until) if t is not None]
            timeout = max(0.0, min(limits) - time.monotonic()) if limits else None
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                stuck = sorted(rank_of[ref] for ref in pending)
                if grace_until is not None:
                    first = min(errors)
                    self._fail(
                        f"{self._worker(first)} failed in {method} ({brief(errors[first])}) and "
                        f"rank(s) {stuck} did not finish within training.collective_timeout_s"
                    )
                self._fail(
                    f"{method} did not finish on rank(s) {stuck} within "
                    f"training.startup_timeout_s={self.config.startup_timeout_s:g} s"
                )
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    errors[rank] = cause_of(exc)
                    if grace_until is None:
                        grace_until = (
                            time.monotonic() + self.config.collective_timeout_s + COLLECTIVE_GRACE_S
                        )
                except ray.exceptions.RayError as exc:  # actor died, its node was lost, ...
                    self._fail(f"{self._worker(rank)} died during {method}: {brief(exc)}")
        if not errors:
            return results
        first = errors[min(errors)]
        refused = len(errors) == len(refs) and all(
            isinstance(e, InvalidRequestError) for e in errors.values()
        )
        if fatal and not refused:
            self._fail(f"{self._worker(min(errors))} failed in {method}: {brief(first)}")
        raise first

    def _call_all(self, method: str, *args: Any, fatal: bool) -> list[Any]:
        return self._call(method, [args] * len(self._actors), fatal=fatal)

    def _call_rank0(self, method: str, *, deadline: float) -> Any:
        return self._call(method, [()], fatal=True, deadline=deadline, actors=self._actors[:1])[0]

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise WorkerGroupError(self._failure)

    # ----- TrainingWorkerGroup ------------------------------------------------------------

    def create_model(self, model_id: str, lora: types.LoraConfig | None) -> None:
        self._check_usable()
        if model_id in self._models:
            raise InvalidRequestError("model_id", f"model '{model_id}' already exists")
        if lora is not None:
            lora_lib.validate_lora_config(lora)
        try:
            sharded = self._call_all("create_model", model_id, lora, fatal=False)
        except WorkerGroupError:
            raise
        except BaseException:  # some ranks may have created it: undo everywhere
            self._call_all("remove_model", model_id, fatal=True)
            raise
        self._models.add(model_id)
        if sharded[0]:
            self._sharded.add(model_id)

    def remove_model(self, model_id: str) -> None:
        self._call_all("remove_model", model_id, fatal=True)
        self._models.discard(model_id)
        self._sharded.discard(model_id)

    def forward_backward(
        self,
        model_id: str,
        examples: list[TrainingExample],
        spec: LossSpec,
        loss_config: dict[str, float],
        backward: bool,
    ) -> ForwardResult:
        self._check_usable()
        parts = partition_by_tokens([e.length for e in examples], len(self._actors))
        sharded = model_id in self._sharded
        num_micro_batches = 0
        if sharded:  # every rank runs as many micro-batches as the busiest one
            budget = self._micro_batch_budget  # the ranks' own (it depends on their dtype)
            num_micro_batches = max(
                len(plan_micro_batches([examples[i].length for i in part], budget))
                for part in parts
            )
        args = [
            (model_id, [examples[i] for i in part], spec, loss_config, backward, num_micro_batches)
            for part in parts
        ]
        try:
            results = self._call("forward_backward", args, fatal=sharded)
        except WorkerGroupError:
            raise
        except BaseException:
            if backward:
                self._call_all("finish_forward_backward", False, fatal=True)
            raise
        if backward:
            self._call_all("finish_forward_backward", True, fatal=True)
        logprobs: list[torch.Tensor | None] = [None] * len(examples)
        for part, result in zip(parts, results, strict=True):
            for i, lp in zip(part, result.logprobs, strict=True):
                logprobs[i] = lp
        return ForwardResult(logprobs, sum(r.loss_sum for r in results))  # type: ignore[arg-type]

    def optim_step(self, model_id: str, adam: types.AdamParams) -> dict[str, float]:
        return self._call_all("optim_step", model_id, adam, fatal=True)[0]

    def save_state(self, model_id: str, directory: Path, with_optimizer: bool) -> None:
        sharded = model_id in self._sharded
        self._call_all("save_state", model_id, directory, with_optimizer, fatal=sharded)

    def load_state(self, model_id: str, directory: Path, with_optimizer: bool) -> None:
        self._call_all("load_state", model_id, directory, with_optimizer, fatal=True)

    def save_sampler_weights(self, model_id: str, directory: Path) -> None:
        self._call_all("save_sampler_weights", model_id, directory, fatal=model_id in self._sharded)

    def full_weights(self, model_id: str) -> dict[str, torch.Tensor]:
        return self._call_all("full_weights", model_id, fatal=model_id in self._sharded)[0]

    def shutdown(self) -> None:
        """Kill the workers and free their placement group (idempotent); later calls fail."""
        if self._failure is None:
            self._failure = f"the training worker group for {self.model_dir} was shut down"
        actors, self._actors = self._actors, []
        for actor in actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
        if self._pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
            self._pg = None
