"""Starting the engine actors of an `EnginePool`: configuration checks, resources, start-up.

What it promises: `launch` returns `config.num_engines` started engine actors in one placement
group (one bundle each, PACK), or fails in bounded time (`sampling.engine_startup_timeout_s`)
with a message naming the config field to change, leaving nothing running. A cluster that could
never hold the engines is refused at once.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from skyrl_trainer.backend.config import SamplingConfig
from skyrl_trainer.backend.distributed import ray_cluster
from skyrl_trainer.backend.distributed.actor_errors import brief, cause_of
from skyrl_trainer.backend.sampling.engine import EngineDiedError
from skyrl_trainer.backend.sampling.ray_engine import EngineActor
from skyrl_trainer.typed_config import ConfigError

PLACEMENTS = ("separate", "colocated")
WEIGHT_SYNCS = ("object_store", "broadcast")
# Turn-taking (ray_engine) needs every call issued to an actor admitted at once: more concurrent
# calls than requests a pool will ever have in flight on one engine.
MAX_CALLS_IN_FLIGHT = 100_000

_EngineActor = ray.remote(max_restarts=0, max_task_retries=0)(EngineActor)


def check_config(config: SamplingConfig) -> None:
    if isinstance(config.num_engines, bool) or config.num_engines < 1:
        raise ConfigError(f"sampling.num_engines: must be >= 1, got {config.num_engines!r}")
    if config.engine_placement not in PLACEMENTS:
        raise ConfigError(
            f"sampling.engine_placement: {config.engine_placement!r} is not one of {PLACEMENTS}"
        )
    if not config.num_cpus_per_engine > 0:
        raise ConfigError("sampling.num_cpus_per_engine: must be > 0")
    if config.num_gpus_per_engine is not None and config.num_gpus_per_engine < 0:
        raise ConfigError("sampling.num_gpus_per_engine: must be >= 0 (or null for automatic)")
    if config.affinity_prefix_tokens < 0:
        raise ConfigError("sampling.affinity_prefix_tokens: must be >= 0")
    if not config.engine_startup_timeout_s > 0:
        raise ConfigError("sampling.engine_startup_timeout_s: must be > 0 seconds")
    if config.weight_sync not in WEIGHT_SYNCS:
        raise ConfigError(
            f"sampling.weight_sync: {config.weight_sync!r} is not one of {WEIGHT_SYNCS}"
        )
    if not config.weight_sync_timeout_s > 0:
        raise ConfigError("sampling.weight_sync_timeout_s: must be > 0 seconds")


def engine_bundle(config: SamplingConfig) -> dict[str, float]:
    """The resources one engine actor reserves."""
    gpus = config.num_gpus_per_engine
    if gpus is None:
        on_gpu = config.device == "cuda" or (
            config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
        )
        gpus = (0.5 if config.engine_placement == "colocated" else 1.0) if on_gpu else 0.0
    bundle = {"CPU": float(config.num_cpus_per_engine)}
    if gpus > 0:
        bundle["GPU"] = float(gpus)
    return bundle


@dataclass
class Launched:
    placement_group: PlacementGroup
    actors: list[Any]
    actor_ids: list[str]
    described: list[dict]  # each actor's `describe()`


def launch(model_dir: Path, config: SamplingConfig, lora: bool) -> Launched:
    """Start the engine actors (see the module docstring); the caller has connected to Ray."""
    check_config(config)
    bundle = engine_bundle(config)
    ray_cluster.check_cluster_size(
        config.num_engines,
        bundle,
        "sampling.num_engines",
        {"CPU": "sampling.num_cpus_per_engine", "GPU": "sampling.num_gpus_per_engine"},
        config.engine_startup_timeout_s,
    )
    n, timeout = config.num_engines, config.engine_startup_timeout_s
    deadline = time.monotonic() + timeout
    pg = placement_group([dict(bundle)] * n, strategy="PACK")
    actors: list[Any] = []
    try:
        if not ray.wait([pg.ready()], timeout=timeout)[0]:
            raise ConfigError(
                f"sampling.num_engines: no room for {n} engines x {bundle} in the Ray cluster "
                f"within sampling.engine_startup_timeout_s={timeout:g} s (available now: "
                f"{ray.available_resources()}). Lower sampling.num_engines, "
                "sampling.num_cpus_per_engine or sampling.num_gpus_per_engine, or free resources."
            )
        sleep_mode = config.engine_placement == "colocated"
        for index in range(n):
            actors.append(
                _EngineActor.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    max_concurrency=MAX_CALLS_IN_FLIGHT,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=index
                    ),
                ).remote(str(model_dir), config, lora, index, sleep_mode)
            )
        ids = [actor._actor_id.hex() for actor in actors]
        refs = [actor.describe.remote() for actor in actors]
        described = []
        for index, ref in enumerate(refs):
            name = f"sampling engine {index} (actor {ids[index]})"
            if not ray.wait([ref], timeout=max(0.0, deadline - time.monotonic()))[0]:
                raise ConfigError(
                    f"sampling.engine_startup_timeout_s: {name} did not start within {timeout:g} s"
                )
            try:
                described.append(ray.get(ref))
            except ray.exceptions.RayError as exc:
                raise EngineDiedError(f"{name} failed to start: {brief(cause_of(exc))}") from exc
        return Launched(pg, actors, ids, described)
    except BaseException:
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
        raise
