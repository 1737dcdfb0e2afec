"""One rank of a multi-worker training group: a `TrainingWorker` inside a torch.distributed group.

The driver (`ray_group.RayTrainingWorkerGroup`) calls the same method on every rank, giving each
rank its share of a request's examples; ranks talk only to each other (gloo on CPU, nccl on CUDA).
A model's weights live on the ranks in one of two ways:

- replicated (LoRA models; full models with `shard_full_models=False`): every rank holds all the
  weights. `forward_backward` needs no communication (each rank accumulates the gradients of its
  own examples); `optim_step` all-reduces the accumulated gradients with SUM (Tinker's loss is a
  sum over datums, so the group's gradient is the sum of the ranks') and every rank applies the
  identical AdamW update, so the replicas stay bit-identical.
- sharded (full fine-tuning, `shard_full_models=True`): FSDP2 `fully_shard` on every decoder
  layer and on a root wrapper, with SUM gradient reduction (gloo lacks PREMUL_SUM/AVG, so the
  reduction is forced to a plain SUM with divide factor 1). Parameters, gradients and AdamW
  moments are sharded. Forward and backward all-gather / reduce-scatter, so every rank runs the
  same number of micro-batches per request (the driver says how many): a rank with fewer runs
  zero-loss filler micro-batches.

`forward_backward` keeps the gradients accumulated before it aside until the driver calls
`finish_forward_backward(commit)`, so a request that fails on any rank changes no rank.
Checkpoints have exactly the single-process worker's format: sharded tensors are gathered into
full tensors and rank 0 writes; every rank loads (the folder must be visible to every rank: one
machine, or storage shared by the nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from tinker import types
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from skyrl_trainer.backend.config import TrainingConfig
from skyrl_trainer.backend.datums import TrainingExample
from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.losses import LossSpec
from skyrl_trainer.backend.model_loading import load_causal_lm
from skyrl_trainer.backend.optimizer import adam_step, make_adamw
from skyrl_trainer.backend.training_worker import (
    ForwardResult,
    ModelDescription,
    TrainingWorker,
    _ModelSlot,
)

#: Elements per all-reduce of replicated gradients (bounds the extra flat buffer).
ALL_REDUCE_BUCKET_NUMEL = 32 * 1024 * 1024


class _LogprobRoot(torch.nn.Module):
    """The FSDP2 root of a sharded model: its forward computes target log-probs, so the
    root-level parameters (embeddings, final norm, tied head) are gathered around it."""

    def __init__(self, hf_model: torch.nn.Module, logprobs_fn):
        super().__init__()
        self.hf_model = hf_model
        self._logprobs_fn = logprobs_fn

    def forward(self, input_ids_BT, mask_BT, targets_BT):
        return self._logprobs_fn(self.hf_model, input_ids_BT, mask_BT, targets_BT)


@dataclass
class _ShardedSlot(_ModelSlot):
    root: _LogprobRoot | None = None


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to its full value (a collective); other tensors as they are."""
    tensor = tensor.detach()
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class TrainingReplica(TrainingWorker):
    """Rank `rank` of `world_size`: the models on one base model, replicated or sharded."""

    def __init__(self, model_dir: str | Path, config: TrainingConfig, rank: int, world_size: int):
        super().__init__(model_dir, config)
        self.rank = rank
        self.world_size = world_size
        self._mesh: DeviceMesh | None = None
        self._pending: tuple[_ModelSlot, list[torch.Tensor | None]] | None = None

    # ----- set-up -------------------------------------------------------------------------

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port for the process group's store (rank 0)."""
        from skyrl_trainer.backend.distributed.ray_cluster import rendezvous_address

        return rendezvous_address()

    def init_process_group(self, address: str, port: int, timeout_s: float) -> None:
        """Join the group; a collective waiting longer than `timeout_s` for a peer raises."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        host = f"[{address}]" if ":" in address else address
        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self._mesh = init_device_mesh(self.device.type, (self.world_size,))

    def model_description(self) -> ModelDescription:
        return self.description

    # ----- models -------------------------------------------------------------------------

    def create_model(self, model_id: str, lora: types.LoraConfig | None) -> bool:
        """Add a model; returns True when its weights are sharded across the ranks."""
        if lora is not None or not (self.config.shard_full_models and self.world_size > 1):
            super().create_model(model_id, lora)
            return False
        if model_id in self._slots:
            raise InvalidRequestError("model_id", f"model '{model_id}' already exists")
        hf_model = load_causal_lm(self.model_dir, torch.float32).to(self.device)
        hf_model.requires_grad_(True)
        root = _LogprobRoot(hf_model, self._causal_lm_logprobs)
        layer_classes = set(getattr(hf_model, "_no_split_modules", None) or ())
        for module in hf_model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=self._mesh)
        fully_shard(root, mesh=self._mesh)
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # SUM over ranks, not the mean
                if hasattr(module, "set_force_sum_reduction_for_comms"):
                    module.set_force_sum_reduction_for_comms(True)  # gloo: plain SUM
        named = list(hf_model.named_parameters())  # DTensors now, same names
        self._slots[model_id] = _ShardedSlot(
            hf_model, None, named, make_adamw([p for _, p in named]), None, root=root
        )
        return True

    # ----- compute ------------------------------------------------------------------------

    def _logprobs(self, slot, input_ids_BT, mask_BT, targets_BT):
        if isinstance(slot, _ShardedSlot):
            return slot.root(input_ids_BT, mask_BT, targets_BT)
        return super()._logprobs(slot, input_ids_BT, mask_BT, targets_BT)

    def forward_backward(
        self,
        model_id: str,
        examples: list[TrainingExample],
        spec: LossSpec,
        loss_config: dict[str, float],
        backward: bool,
        num_micro_batches: int = 0,
    ) -> ForwardResult:
        """This rank's share: log-probs (in the order given) and its summed loss.

        With `backward`, the new gradients stay apart from the earlier accumulated ones until
        `finish_forward_backward`. A sharded model runs at least `num_micro_batches`
        micro-batches (filler ones add nothing), as every rank must.
        """
        if self._pending is not None:
            raise RuntimeError("the previous forward_backward was not finished")
        slot = self._slot(model_id)
        if backward:
            self._pending = (slot, [p.grad for p in slot.params])
            for p in slot.params:
                p.grad = None
        logprobs: list[torch.Tensor | None] = [None] * len(examples)
        loss_sum = 0.0
        try:
            # Sharded ranks must all run the same backwards (their collectives pair up), so only
            # replicated models skip the backward of zero-gradient datums.
            sharded = isinstance(slot, _ShardedSlot)
            plan = self._micro_batch_plan(examples, spec, backward, skip_zero_gradient=not sharded)
            for indices, with_grad in plan:
                batch = [examples[i] for i in indices]
                lps, loss = self._forward_micro_batch(slot, batch, spec, loss_config, with_grad)
                loss_sum += loss
                for i, lp in zip(indices, lps, strict=True):
                    logprobs[i] = lp
            if sharded:
                for _ in range(num_micro_batches - len(plan)):
                    self._filler_micro_batch(slot, backward)
        except BaseException:
            self.finish_forward_backward(commit=False)
            raise
        return ForwardResult(logprobs, loss_sum)  # type: ignore[arg-type]

    def _filler_micro_batch(self, slot: _ModelSlot, backward: bool) -> None:
        """One token through the model with zero loss: takes part in the collectives only."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        mask = torch.ones((1, 1), dtype=torch.bool, device=self.device)
        with torch.set_grad_enabled(backward), self._autocast():
            logprobs = self._logprobs(slot, ids, mask, ids)
        if backward:
            (logprobs.sum() * 0.0).backward()

    def finish_forward_backward(self, commit: bool) -> None:
        """Add the last request's gradients to the accumulated ones, or drop them."""
        if self._pending is None:
            return
        slot, saved = self._pending
        self._pending = None
        for p, g in zip(slot.params, saved, strict=True):
            if not commit:
                p.grad = g
            elif g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)

    def optim_step(self, model_id: str, adam: types.AdamParams) -> dict[str, float]:
        """Sum the ranks' gradients (replicated models; FSDP2 already did) and step."""
        slot = self._slot(model_id)
        if not isinstance(slot, _ShardedSlot):
            self._all_reduce_grads(slot.params)
        return adam_step(slot.optimizer, slot.params, adam)

    def _all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """SUM every gradient over the ranks, in flat buckets. A parameter no rank has a
        gradient for keeps None (as in one process: AdamW then leaves it alone)."""
        has_grad = torch.tensor(
            [float(p.grad is not None) for p in params], device=self.device, dtype=torch.float32
        )
        dist.all_reduce(has_grad)
        todo = [p for p, has in zip(params, has_grad.tolist(), strict=True) if has > 0]
        for p, has in zip(params, has_grad.tolist(), strict=True):
            if has == 0:
                p.grad = None
        while todo:
            dtype = todo[0].dtype
            bucket, numel = [], 0
            for p in todo:
                if p.dtype == dtype and (
                    not bucket or numel + p.numel() <= ALL_REDUCE_BUCKET_NUMEL
                ):
                    bucket.append(p)
                    numel += p.numel()
            flat = torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                    for p in bucket
                ]
            )
            dist.all_reduce(flat)
            offset = 0
            for p in bucket:
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            bucket_ids = {id(p) for p in bucket}
            todo = [p for p in todo if id(p) not in bucket_ids]

    # ----- state --------------------------------------------------------------------------

    def save_state(self, model_id: str, directory: Path, with_optimizer: bool) -> None:
        """Rank 0 writes the single-process format; sharded tensors are gathered first."""
        slot = self._slot(model_id)
        if isinstance(slot, _ShardedSlot) or self.rank == 0:
            super().save_state(model_id, directory, with_optimizer)

    def _export_weights(self, slot: _ModelSlot) -> dict[str, torch.Tensor]:
        if not isinstance(slot, _ShardedSlot):
            return super()._export_weights(slot)
        tensors = {}
        for name, param in slot.named_params:
            full = _full(param)  # every rank takes part in the gather
            if self.rank == 0:
                tensors[self._file_key(slot, name)] = full.contiguous().cpu()
        return tensors

    def _export_optimizer_state(self, slot: _ModelSlot) -> dict:
        state = slot.optimizer.state_dict()
        if not isinstance(slot, _ShardedSlot):
            return state
        return {
            "state": {
                index: {key: _full(value).cpu() for key, value in sorted(per_param.items())}
                for index, per_param in sorted(state["state"].items())
            },
            "param_groups": state["param_groups"],
        }

    def _write_state(self, slot, directory, tensors, optimizer_state) -> None:
        if self.rank == 0:
            super()._write_state(slot, directory, tensors, optimizer_state)

    def _import_weight(self, param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
        if isinstance(param, DTensor):  # keep this rank's shard of the full tensor
            tensor = self._shard_like(param, tensor)
            param.to_local().copy_(tensor.to_local())
        else:
            param.copy_(tensor)

    def _import_optimizer_state(self, slot: _ModelSlot, state: dict) -> None:
        if isinstance(slot, _ShardedSlot):
            params = slot.params
            state = {
                "state": {
                    index: {
                        key: self._shard_like(params[index], value)
                        if key != "step" and isinstance(params[index], DTensor)
                        else value
                        for key, value in per_param.items()
                    }
                    for index, per_param in state["state"].items()
                },
                "param_groups": state["param_groups"],
            }
        slot.optimizer.load_state_dict(state)

    def _shard_like(self, param: DTensor, tensor: torch.Tensor) -> DTensor:
        """`tensor` (the full value) as a DTensor placed like `param`; no communication."""
        local = tensor.detach().to(device=self.device, dtype=param.dtype)
        return distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)

    def full_weights(self, model_id: str) -> dict[str, torch.Tensor]:
        """Rank 0: the full model's weights on CPU (gathered if sharded); other ranks: {}."""
        slot = self._slot(model_id)
        if slot.adapter_name is not None:
            raise InvalidRequestError("model_id", f"model '{model_id}' is a LoRA model")
        weights = {}
        for name, param in slot.named_params:
            if isinstance(param, DTensor) or self.rank == 0:
                full = _full(param)
                if self.rank == 0:
                    weights[name] = full.cpu().clone()
        return weights

    def local_weights(self, model_id: str) -> dict[str, torch.Tensor]:
        """This rank's own copy of the trainable weights (its shard, when sharded), on CPU:
        for checking that replicas agree."""
        slot = self._slot(model_id)
        return {
            name: (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in slot.named_params
        }
