"""The broadcast path of weight sync (`sampling.weight_broadcast`): bucket packing, a gloo group
of threads, and an `EnginePool` with `weight_sync: broadcast` against a plain float32 forward."""

from __future__ import annotations

import threading

import torch

from skyrl_trainer.backend.distributed.ray_cluster import rendezvous_address
from skyrl_trainer.backend.sampling.weight_broadcast import (
    WeightReceiver,
    WeightSender,
    pack,
    plan_buckets,
    unpack,
)


def test_buckets_round_trip():
    torch.manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5),
        "scalar": torch.randn(()),
        "big": torch.randn(40),  # larger than a bucket: a bucket of its own
        "b": torch.randn(2, 2, 2),
    }
    slots, sizes = plan_buckets({n: tuple(t.shape) for n, t in tensors.items()}, 4, 64)
    assert sizes == [16, 40, 8]  # a + scalar, big, b
    assert sum(sizes) == sum(t.numel() for t in tensors.values())
    for dtype in (torch.float32, torch.bfloat16):
        out = unpack(pack(tensors, slots, sizes, dtype, "cpu"), slots)
        assert list(out) == list(tensors)
        for name, tensor in tensors.items():
            assert out[name].shape == tensor.shape and out[name].dtype == dtype
            torch.testing.assert_close(out[name], tensor.to(dtype), rtol=0, atol=0)


def test_gloo_group_sends_every_bucket_to_every_receiver():
    """Rank 0 and two receivers in threads of this process, on a real gloo process group."""
    torch.manual_seed(1)
    tensors = {f"w{i}": torch.randn(7, i + 1) for i in range(5)}
    slots, sizes = plan_buckets({n: tuple(t.shape) for n, t in tensors.items()}, 4, 100)
    assert len(sizes) > 1
    sender = WeightSender("gloo", timeout_s=30)
    host, port = "127.0.0.1", rendezvous_address()[1]
    results, errors = {}, []

    def receiver(rank: int) -> None:
        try:
            r = WeightReceiver()
            r.join(host, port, rank, 3, "gloo", 30)
            for round_ in range(2):
                results[(rank, round_)] = r.receive(slots, sizes, torch.float32)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=receiver, args=(rank,)) for rank in (1, 2)]
    for t in threads:
        t.start()
    sender.form([0, 1], host, port)
    assert sender.members == [0, 1]
    for round_ in range(2):
        scaled = {n: t * (round_ + 1) for n, t in tensors.items()}
        sender.send(pack(scaled, slots, sizes, torch.float32, "cpu"))
    for t in threads:
        t.join(60)
    assert not errors
    for (_rank, round_), got in results.items():
        for name, tensor in tensors.items():
            torch.testing.assert_close(got[name], tensor * (round_ + 1), rtol=0, atol=0)
    assert len(results) == 4
