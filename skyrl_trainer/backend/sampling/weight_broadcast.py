"""Weight updates to engine actors by a torch.distributed broadcast (gloo on CPU, NCCL on GPU).

With `sampling.weight_sync: broadcast` an `EnginePool` forms a process group of its own with its
engine actors: the pool's process, which holds the trained weights, is rank 0, and each live
engine a further rank. The group is built on a TCPStore the pool hosts; no default process group
is created or touched, so a trainer's own torch.distributed set-up is unaffected. An update goes
as flat buckets in the sampling dtype: the pool packs the tensors, every rank receives each
bucket, and each engine unpacks views by (name, shape, offset) and applies them with its usual
`update_weights` (which checks names and shapes before changing anything).

A failed collective leaves a group unusable, so after any failure the pool forms a new one with
the engines still alive. A peer that dies mid-broadcast fails it on every rank within
`sampling.weight_sync_timeout_s` at worst.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 * 2**20  # per collective: large enough to amortise, small enough to stage


@dataclass(frozen=True)
class TensorSlot:
    """Where one named tensor lives in the buckets of an update."""

    name: str
    shape: tuple[int, ...]
    bucket: int
    offset: int  # in elements


def plan_buckets(
    shapes: dict[str, tuple[int, ...]], element_size: int, bucket_bytes: int = BUCKET_BYTES
) -> tuple[list[TensorSlot], list[int]]:
    """Pack tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor gets a
    bucket of its own). Returns every tensor's slot and each bucket's size in elements."""
    limit = max(1, bucket_bytes // element_size)
    slots: list[TensorSlot] = []
    sizes: list[int] = []
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if not sizes or (sizes[-1] and sizes[-1] + numel > limit):
            sizes.append(0)
        slots.append(TensorSlot(name, tuple(int(d) for d in shape), len(sizes) - 1, sizes[-1]))
        sizes[-1] += numel
    return slots, sizes


def pack(
    tensors: dict[str, torch.Tensor],
    slots: list[TensorSlot],
    sizes: list[int],
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    buckets = [torch.empty(size, dtype=dtype, device=device) for size in sizes]
    for slot in slots:
        flat = tensors[slot.name].detach().reshape(-1)
        buckets[slot.bucket][slot.offset : slot.offset + flat.numel()].copy_(flat)
    return buckets


def unpack(buckets: list[torch.Tensor], slots: list[TensorSlot]) -> dict[str, torch.Tensor]:
    out = {}
    for slot in slots:
        numel = math.prod(slot.shape)
        out[slot.name] = buckets[slot.bucket][slot.offset : slot.offset + numel].view(slot.shape)
    return out


def make_group(backend: str, store, rank: int, world_size: int, timeout_s: float):
    """A process group of `world_size` ranks on `store` (blocks until every rank has joined)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"unknown backend {backend!r}; 'gloo' or 'nccl'")


class WeightReceiver:
    """An engine actor's end of the group."""

    def __init__(self):
        self.group = None
        self.device = "cpu"

    def join(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s):
        store = dist.TCPStore(
            host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
        self.device = "cuda" if backend == "nccl" else "cpu"
        self.group = make_group(backend, store, rank, world_size, timeout_s)

    def receive(
        self, slots: list[TensorSlot], sizes: list[int], dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        if self.group is None:
            raise RuntimeError("this engine has not joined a weight group")
        buckets = [torch.empty(size, dtype=dtype, device=self.device) for size in sizes]
        try:
            for bucket in buckets:
                self.group.broadcast(bucket, 0).wait()
        except BaseException:
            self.group = None  # unusable after a failed collective
            raise
        return unpack(buckets, slots)


class WeightSender:
    """The pool's end of the group (rank 0) and the engines it was formed with."""

    def __init__(self, backend: str, timeout_s: float):
        self.backend, self.timeout_s = backend, timeout_s
        self.members: list[int] = []  # engine indices, rank = position + 1
        self.group = None
        self._store = None

    def form(self, members: list[int], host: str, port: int) -> None:
        """Host the store and join as rank 0; every member must join concurrently."""
        self.group, self.members = None, []
        world = len(members) + 1
        self._store = dist.TCPStore(
            host,
            port,
            world,
            is_master=True,
            timeout=timedelta(seconds=self.timeout_s),
            wait_for_workers=False,
        )
        self.group = make_group(self.backend, self._store, 0, world, self.timeout_s)
        self.members = list(members)

    def send(self, buckets: list[torch.Tensor]) -> None:
        try:
            for bucket in buckets:
                self.group.broadcast(bucket, 0).wait()
        except BaseException:
            self.group, self.members = None, []
            raise
