"""Reach the Ray cluster that training workers run on, in bounded time, and size it up.

- `connect`: reuse the Ray already initialised in this process; else join `training.ray.address`
  (after checking that its host answers) or start a local Ray. `ray.init` runs on one long-lived
  daemon thread: a local Ray's GCS and raylet are child processes that Linux kills (parent-death
  signal) when the *thread* that started them exits, and the backend creates worker groups on
  executor threads that may end. Start-up or joining that takes longer than
  `training.ray.connect_timeout_s` fails with a message naming the field, never hangs.
- `gpus_per_worker` / `check_cluster_size`: what each worker reserves, and a fast refusal when
  the whole cluster could never hold the actors asked for (training workers or sampling engines).
- `rendezvous_address`: this node's address and a free port, for a process group's store.
"""

from __future__ import annotations

import logging
import socket
import threading

import ray

from skyrl_trainer.backend.config import RayConfig, TrainingConfig
from skyrl_trainer.typed_config import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_GCS_PORT = 6379
DEFAULT_CLIENT_PORT = 10001

_lock = threading.Lock()


def rendezvous_address() -> tuple[str, int]:
    """This node's address and a free port, for a process-group store hosted here."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def check_reachable(address: str, timeout_s: float) -> None:
    """Refuse an address whose host:port does not accept a TCP connection."""
    if address == "auto":
        return
    target = address.removeprefix("ray://")
    default_port = DEFAULT_CLIENT_PORT if address.startswith("ray://") else DEFAULT_GCS_PORT
    host, _, port = target.rpartition(":") if ":" in target else (target, "", str(default_port))
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"training.ray.address: cannot reach a Ray cluster at {address!r} within "
            f"{timeout_s:g} s ({exc}). Start one (`ray start --head`), fix the address, or set "
            "training.ray.address to null for a local Ray."
        ) from exc


def connect(config: RayConfig) -> None:
    """Make this process a Ray driver (idempotent)."""
    with _lock:
        if ray.is_initialized():
            return
        if config.address:
            check_reachable(config.address, min(config.connect_timeout_s, 10.0))
            kwargs = {"address": config.address}
        else:
            kwargs = {"num_cpus": config.num_cpus, "include_dashboard": False}
        done = threading.Event()
        outcome: list[BaseException | None] = []

        def owner() -> None:
            try:
                ray.init(**kwargs)
                outcome.append(None)
            except BaseException as exc:  # reported to the caller below
                outcome.append(exc)
            done.set()
            if outcome[0] is None:
                threading.Event().wait()  # keep Ray's child processes alive with this thread

        threading.Thread(target=owner, name="skyrl-ray-owner", daemon=True).start()
        where = f"at {config.address!r}" if config.address else "locally"
        if not done.wait(config.connect_timeout_s):
            raise ConfigError(
                f"training.ray.address: Ray did not start or connect {where} within "
                f"training.ray.connect_timeout_s={config.connect_timeout_s:g} s."
            )
        if outcome[0] is not None:
            raise ConfigError(
                f"training.ray.address: Ray failed to start or connect {where}: {outcome[0]}"
            ) from outcome[0]
        logger.info("Ray %s: %s", where, ray.cluster_resources())


def gpus_per_worker(config: TrainingConfig) -> float:
    """`num_gpus_per_worker`, or its default: 1 when the workers will compute on CUDA."""
    if config.num_gpus_per_worker is not None:
        return config.num_gpus_per_worker
    if config.device == "cuda":
        return 1.0
    if config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0:
        return 1.0
    return 0.0


def worker_bundle(config: TrainingConfig) -> dict[str, float]:
    """The resources one worker reserves (a placement-group bundle)."""
    bundle = {"CPU": float(config.num_cpus_per_worker)}
    gpus = gpus_per_worker(config)
    if gpus > 0:
        bundle["GPU"] = gpus
    return bundle


def check_cluster_size(
    count: int,
    bundle: dict[str, float],
    count_field: str,
    resource_fields: dict[str, str],
    startup_timeout_s: float,
) -> None:
    """Refuse at once when the cluster, even idle, cannot hold `count` actors of `bundle`.
    Resources that exist but are busy are waited for, up to `startup_timeout_s`.
    `count_field` / `resource_fields` name the config fields the message tells to change."""
    total = ray.cluster_resources()
    available = ray.available_resources()
    for resource, each in bundle.items():
        need = each * count
        field = resource_fields[resource]
        if need > total.get(resource, 0.0) + 1e-9:
            raise ConfigError(
                f"{count_field}: {count} x {each:g} {resource} ({field}) need {need:g} "
                f"{resource}, but the Ray cluster has {total.get(resource, 0.0):g} in total "
                f"({available.get(resource, 0.0):g} available). Lower {count_field} or {field}, "
                "or add nodes."
            )
        if need > available.get(resource, 0.0) + 1e-9:
            logger.warning(
                "%s: need %g %s, %g available now: waiting up to %g s",
                count_field,
                need,
                resource,
                available.get(resource, 0.0),
                startup_timeout_s,
            )
