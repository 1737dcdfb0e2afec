"""A training worker: one base model, the trainable models on it, and their compute.

LoRA models share the worker's one frozen base (each is a PEFT adapter); a full fine-tuning
model owns a float32 copy. The worker turns validated `TrainingExample`s into per-token
log-probs, sums the loss, accumulates gradients and steps optimizers. It knows nothing about
sessions, futures or checkpoint paths: that is the core's job.

A few small methods (`_logprobs`, `_export_weights`, `_export_optimizer_state`, `_write_state`,
`_import_weight`, `_import_optimizer_state`) are the seams a multi-worker replica
(`distributed.replica`) overrides to shard weights; here they do the plain single-process thing.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from tinker import types
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, PreTrainedModel

from skyrl_trainer.backend import lora as lora_lib
from skyrl_trainer.backend.compute_dtype import resolve_compute_dtype
from skyrl_trainer.backend.config import TrainingConfig
from skyrl_trainer.backend.datums import TrainingExample
from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.losses import LossSpec
from skyrl_trainer.backend.micro_batches import pad_right, plan_micro_batches
from skyrl_trainer.backend.model_loading import load_causal_lm
from skyrl_trainer.backend.optimizer import adam_step, make_adamw
from skyrl_trainer.backend.target_logprobs import target_logprobs

ADAPTER_WEIGHTS = "adapter_model.safetensors"
FULL_WEIGHTS = "model.safetensors"
OPTIMIZER_STATE = "optimizer.pt"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


@dataclass(frozen=True)
class ModelDescription:
    """What the core needs to know about a worker's base model to validate requests."""

    arch: str
    vocab_size: int
    max_length: int
    model_dir: str


@dataclass
class ForwardResult:
    logprobs: list[torch.Tensor]  # per datum, float32, the shape of its target_tokens
    loss_sum: float


@dataclass
class _ModelSlot:
    hf_model: PreTrainedModel  # the causal LM to run (shared PEFT-injected base, or own copy)
    adapter_name: str | None  # None for full fine-tuning
    named_params: list[tuple[str, torch.nn.Parameter]]  # trainable, stable order
    optimizer: torch.optim.AdamW
    lora: types.LoraConfig | None

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_params]


def _padded_targets(examples: list[TrainingExample], width: int) -> torch.Tensor:
    """The examples' target tokens right-padded (with 0) to (B, width), or to (B, width, K_max)
    when any example has several targets per position (a 1-D example fills column 0)."""
    targets = [e.loss_inputs["target_tokens"] for e in examples]
    if all(t.dim() == 1 for t in targets):
        return pad_right(targets).input_ids_BT
    k_max = max(t.shape[1] if t.dim() == 2 else 1 for t in targets)
    out = torch.zeros((len(targets), width, k_max), dtype=torch.long)
    for row, t in enumerate(targets):
        t = t if t.dim() == 2 else t[:, None]
        out[row, : t.shape[0], : t.shape[1]] = t
    return out


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class TrainingWorker:
    """Runs every training request for the models on one base model, one at a time."""

    def __init__(self, model_dir: str | Path, config: TrainingConfig):
        self.model_dir = Path(model_dir)
        self.config = config
        self.device = resolve_device(config.device)
        self.compute_dtype = resolve_compute_dtype(
            config.dtype, self.device, field="backend.training.dtype"
        )
        hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.description = ModelDescription(
            arch=(hf_config.architectures or [type(hf_config).__name__])[0],
            vocab_size=int(hf_config.vocab_size),
            max_length=int(getattr(hf_config, "max_position_embeddings", 2048)),
            model_dir=str(self.model_dir),
        )
        self._lora_base: PreTrainedModel | PeftModel | None = None  # loaded with the first adapter
        self._layer_kinds: dict[str, str] = {}  # Linear layer -> attn/mlp/unembed/other
        self._slots: dict[str, _ModelSlot] = {}
        self._adapter_count = 0

    # ----- models -------------------------------------------------------------------------

    def create_model(self, model_id: str, lora: types.LoraConfig | None) -> None:
        """Add a trainable model: a new LoRA adapter on the shared base, or a full copy."""
        if model_id in self._slots:
            raise InvalidRequestError("model_id", f"model '{model_id}' already exists")
        if lora is None:
            hf_model = load_causal_lm(self.model_dir, torch.float32).to(self.device)
            named = list(hf_model.named_parameters())
            for _, p in named:
                p.requires_grad_(True)
            self._slots[model_id] = _ModelSlot(
                hf_model, None, named, make_adamw([p for _, p in named]), None
            )
            return
        lora_lib.validate_lora_config(lora)
        if self._lora_base is None:
            self._lora_base = load_causal_lm(self.model_dir, self.compute_dtype).to(self.device)
            self._layer_kinds = lora_lib.classify_linear_layers(self._lora_base)
        adapter_name = f"adapter{self._adapter_count}"
        self._adapter_count += 1
        self._lora_base = lora_lib.add_lora_adapter(
            self._lora_base, self._layer_kinds, adapter_name, lora
        )
        named = lora_lib.adapter_parameters(self._lora_base, adapter_name)
        self._slots[model_id] = _ModelSlot(
            self._lora_base.base_model.model,
            adapter_name,
            named,
            make_adamw([p for _, p in named]),
            lora,
        )

    def remove_model(self, model_id: str) -> None:
        """Drop a model and free its weights and optimizer state (the shared base stays)."""
        slot = self._slots.pop(model_id, None)
        if slot is not None and slot.adapter_name is not None:
            assert isinstance(self._lora_base, PeftModel)
            self._lora_base.delete_adapter(slot.adapter_name)

    def shutdown(self) -> None:
        """Nothing to stop: an in-process worker holds no processes (its memory goes with it)."""

    def _slot(self, model_id: str) -> _ModelSlot:
        slot = self._slots.get(model_id)
        if slot is None:
            raise InvalidRequestError("model_id", f"unknown model '{model_id}'")
        if slot.adapter_name is not None:
            assert isinstance(self._lora_base, PeftModel)
            self._lora_base.set_adapter(slot.adapter_name)
        return slot

    # ----- compute ------------------------------------------------------------------------

    def micro_batch_budget(self) -> int:
        """Padded tokens per micro-batch. `micro_batch_tokens` counts 2-byte (bf16) activations;
        float32 compute gets half as many, so peak activation memory (the logits above all:
        tokens x vocab x bytes) stays the same whatever the dtype."""
        return max(1, self.config.micro_batch_tokens * 2 // self.compute_dtype.itemsize)

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _target_logprobs(
        self, head: torch.nn.Module, hidden_ND: torch.Tensor, targets_N: torch.Tensor
    ) -> torch.Tensor:
        """log p(target) for each row (float32).

        Default: one vocabulary projection, whose logits (compute dtype) are kept for backward;
        memory is bounded by `micro_batch_tokens`. With `recompute_logits`, the projection runs
        in chunks of `logprob_chunk_tokens` and is recomputed in backward, so only one chunk's
        logits exist at a time (for large vocabularies on small devices).
        """
        step = self.config.logprob_chunk_tokens
        if not (self.config.recompute_logits and torch.is_grad_enabled()):
            return target_logprobs(head(hidden_ND), targets_N, chunk=step)

        def chunk_logprobs(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return target_logprobs(head(h), t, chunk=step)

        chunks = [
            checkpoint(
                chunk_logprobs,
                hidden_ND[start : start + step],
                targets_N[start : start + step],
                use_reentrant=False,
            )
            for start in range(0, hidden_ND.shape[0], step)
        ]
        return torch.cat(chunks)

    def _logprobs(
        self,
        slot: _ModelSlot,
        input_ids_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        targets_BT: torch.Tensor,
    ) -> torch.Tensor:
        """log p(target) of the real (unmasked) tokens, flattened row by row."""
        return self._causal_lm_logprobs(slot.hf_model, input_ids_BT, mask_BT, targets_BT)

    def _causal_lm_logprobs(
        self,
        hf_model: PreTrainedModel,
        input_ids_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        targets_BT: torch.Tensor,
    ) -> torch.Tensor:
        hidden_BTD = hf_model.get_decoder()(
            input_ids=input_ids_BT, attention_mask=mask_BT.long(), use_cache=False
        ).last_hidden_state
        # Drop padding before the vocabulary projection: rows are row-major, so each
        # example's tokens stay contiguous in the flattened order.
        return self._target_logprobs(
            hf_model.get_output_embeddings(), hidden_BTD[mask_BT], targets_BT[mask_BT]
        )

    def _forward_micro_batch(
        self,
        slot: _ModelSlot,
        examples: list[TrainingExample],
        spec: LossSpec,
        loss_config: dict[str, float],
        backward: bool,
    ) -> tuple[list[torch.Tensor], float]:
        inputs = pad_right([e.input_ids_N for e in examples])
        targets = _padded_targets(examples, inputs.input_ids_BT.shape[1])
        with torch.set_grad_enabled(backward), self._autocast():
            logprobs_N = self._logprobs(
                slot,
                inputs.input_ids_BT.to(self.device),
                inputs.mask_BT.to(self.device),
                targets.to(self.device),
            )
        with torch.set_grad_enabled(backward):
            per_example = torch.split(logprobs_N, [e.length for e in examples])
            if targets.dim() == 3:  # (N, K_max) each: back to each datum's own targets' shape
                per_example = [
                    lp[:, : t.shape[1]] if t.dim() == 2 else lp[:, 0]
                    for lp, t in zip(
                        per_example, (e.loss_inputs["target_tokens"] for e in examples)
                    )
                ]
            losses = [
                spec.fn(lp, {k: v.to(self.device) for k, v in e.loss_inputs.items()}, loss_config)
                for lp, e in zip(per_example, examples, strict=True)
            ]
            loss = torch.stack(losses).sum()
        if backward:
            loss.backward()
        return [lp.detach().float().cpu() for lp in per_example], float(loss.detach())

    def _micro_batch_plan(
        self,
        examples: list[TrainingExample],
        spec: LossSpec,
        backward: bool,
        skip_zero_gradient: bool = True,
    ) -> list[tuple[list[int], bool]]:
        """(example indices, run backward) of each micro-batch.

        A datum whose `spec.gradient_weight_input` is all zero (e.g. a GRPO group whose rewards
        are all equal) adds exactly nothing to the gradient: it gets a forward only, for its
        log-probs and loss, which costs about a third of forward + backward.
        """
        lengths = [e.length for e in examples]
        budget = self.micro_batch_budget()
        key = spec.gradient_weight_input
        if not (backward and skip_zero_gradient and key is not None):
            return [(mb, backward) for mb in plan_micro_batches(lengths, budget)]
        live = [bool(torch.any(e.loss_inputs[key] != 0)) for e in examples]
        plan = []
        for with_grad in (True, False):
            subset = [i for i in range(len(examples)) if live[i] == with_grad]
            for mb in plan_micro_batches([lengths[i] for i in subset], budget):
                plan.append(([subset[j] for j in mb], with_grad))
        return plan

    def forward_backward(
        self,
        model_id: str,
        examples: list[TrainingExample],
        spec: LossSpec,
        loss_config: dict[str, float],
        backward: bool,
    ) -> ForwardResult:
        """Per-token log-probs and the summed loss; with `backward`, add its gradients.

        Gradients accumulate across calls until `optim_step`. If anything fails mid-request,
        the gradients accumulated before it are restored, so a failed request changes nothing.
        """
        slot = self._slot(model_id)
        saved_grads = [p.grad for p in slot.params]
        for p in slot.params:
            p.grad = None
        logprobs: list[torch.Tensor | None] = [None] * len(examples)
        loss_sum = 0.0
        try:
            for indices, with_grad in self._micro_batch_plan(examples, spec, backward):
                batch = [examples[i] for i in indices]
                lps, loss = self._forward_micro_batch(slot, batch, spec, loss_config, with_grad)
                loss_sum += loss
                for i, lp in zip(indices, lps, strict=True):
                    logprobs[i] = lp
        except BaseException:
            for p, g in zip(slot.params, saved_grads, strict=True):
                p.grad = g
            raise
        for p, g in zip(slot.params, saved_grads, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        return ForwardResult(logprobs, loss_sum)  # type: ignore[arg-type]

    def optim_step(self, model_id: str, adam: types.AdamParams) -> dict[str, float]:
        slot = self._slot(model_id)
        return adam_step(slot.optimizer, slot.params, adam)

    # ----- state --------------------------------------------------------------------------

    def _file_key(self, slot: _ModelSlot, name: str) -> str:
        # PEFT's on-disk names carry no adapter name: "...q_proj.lora_A.weight".
        return name.replace(f".{slot.adapter_name}.", ".") if slot.adapter_name else name

    def save_state(self, model_id: str, directory: Path, with_optimizer: bool) -> None:
        """Write the model's trainable weights (PEFT adapter folder or full HF weights)."""
        slot = self._slot(model_id)
        tensors = self._export_weights(slot)
        optimizer_state = self._export_optimizer_state(slot) if with_optimizer else None
        self._write_state(slot, directory, tensors, optimizer_state)

    def _export_weights(self, slot: _ModelSlot) -> dict[str, torch.Tensor]:
        """The trainable weights as full CPU tensors, by file key."""
        return {
            self._file_key(slot, n): p.detach().contiguous().cpu() for n, p in slot.named_params
        }

    def _export_optimizer_state(self, slot: _ModelSlot) -> dict:
        return slot.optimizer.state_dict()

    def _write_state(
        self,
        slot: _ModelSlot,
        directory: Path,
        tensors: dict[str, torch.Tensor],
        optimizer_state: dict | None,
    ) -> None:
        if slot.adapter_name is not None:
            assert isinstance(self._lora_base, PeftModel)
            save_file(tensors, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
            adapter_config = self._lora_base.peft_config[slot.adapter_name]
            config_dict = adapter_config.to_dict()
            config_dict["base_model_name_or_path"] = str(self.model_dir)
            config_dict["target_modules"] = sorted(config_dict["target_modules"])
            config_dict["inference_mode"] = True
            (directory / "adapter_config.json").write_text(json.dumps(config_dict, indent=2))
        else:
            save_file(tensors, directory / FULL_WEIGHTS, metadata={"format": "pt"})
            slot.hf_model.config.save_pretrained(directory)
            for name in TOKENIZER_FILES:  # a complete HF folder: transformers/vLLM load it as is
                if (self.model_dir / name).exists():
                    shutil.copy2(self.model_dir / name, directory / name)
        if optimizer_state is not None:
            torch.save(
                {
                    "param_names": [self._file_key(slot, n) for n, _ in slot.named_params],
                    "state": optimizer_state,
                },
                directory / OPTIMIZER_STATE,
            )

    def save_sampler_weights(self, model_id: str, directory: Path) -> None:
        """Weights a sampler (or plain transformers / vLLM) loads directly: a PEFT adapter
        folder, or a full Hugging Face model folder with the tokenizer."""
        self.save_state(model_id, directory, with_optimizer=False)

    def full_weights(self, model_id: str) -> dict[str, torch.Tensor]:
        """A full fine-tuning model's weights by Hugging Face name (detached copies)."""
        slot = self._slot(model_id)
        if slot.adapter_name is not None:
            raise InvalidRequestError("model_id", f"model '{model_id}' is a LoRA model")
        return {name: p.detach().clone() for name, p in slot.named_params}

    def load_state(self, model_id: str, directory: Path, with_optimizer: bool) -> None:
        """Load weights saved by `save_state`; the optimizer state too, or a fresh optimizer.

        Checks every tensor's name and shape before copying any, so a mismatched checkpoint
        leaves the model as it was.
        """
        slot = self._slot(model_id)
        weights_file = directory / (ADAPTER_WEIGHTS if slot.adapter_name else FULL_WEIGHTS)
        if not weights_file.exists():
            kind = "LoRA adapter" if slot.adapter_name else "full-weights"
            raise InvalidRequestError(
                "path", f"checkpoint has no {weights_file.name}; it is not a {kind} checkpoint"
            )
        tensors = load_file(weights_file)
        expected = {self._file_key(slot, n): p for n, p in slot.named_params}
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected))
        if missing or unexpected:
            raise InvalidRequestError(
                "path",
                f"checkpoint weights do not match this model: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]} (different LoRA targets or architecture?)",
            )
        for key, param in expected.items():
            if tuple(tensors[key].shape) != tuple(param.shape):
                raise InvalidRequestError(
                    "path",
                    f"checkpoint tensor {key} has shape {list(tensors[key].shape)}, this model "
                    f"has {list(param.shape)} (different LoRA rank?)",
                )
        optimizer_state = None
        if with_optimizer:
            optim_file = directory / OPTIMIZER_STATE
            if not optim_file.exists():
                raise InvalidRequestError(
                    "path", "checkpoint has no optimizer state; save it with save_state"
                )
            saved = torch.load(optim_file, map_location="cpu", weights_only=True)
            if saved["param_names"] != list(expected):
                raise InvalidRequestError("path", "optimizer state does not match this model")
            optimizer_state = saved["state"]
        with torch.no_grad():
            for key, param in expected.items():
                self._import_weight(param, tensors[key])
                param.grad = None
        slot.optimizer = make_adamw(slot.params)
        if optimizer_state is not None:
            self._import_optimizer_state(slot, optimizer_state)

    def _import_weight(self, param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
        """Copy a full checkpoint tensor into a parameter (under no_grad)."""
        param.copy_(tensor)

    def _import_optimizer_state(self, slot: _ModelSlot, state: dict) -> None:
        slot.optimizer.load_state_dict(state)
