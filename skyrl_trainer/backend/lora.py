"""LoRA adapters on a shared base model (PEFT), selected with Tinker's `LoraConfig` flags.

All LoRA models on one base share its frozen weights: each model is one named PEFT adapter,
activated for the duration of that model's request.
"""

from __future__ import annotations

import warnings

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from tinker import types
from transformers import PreTrainedModel

from skyrl_trainer.backend.errors import InvalidRequestError

# Tinker does not publish its alpha; we fix alpha = 32 (scale = 32 / rank), the usual
# choice in LoRA RL recipes. Saved in adapter_config.json, so loaders apply the same scale.
LORA_ALPHA = 32
MAX_LORA_RANK = 256

_ATTN_PARENTS = ("self_attn", "attn", "attention", "self_attention")
_MLP_PARENTS = ("mlp", "feed_forward", "ffn", "block_sparse_moe")


def classify_linear_layers(model: PreTrainedModel) -> dict[str, str]:
    """Map each Linear layer of a clean (not yet PEFT-wrapped) model to attn/mlp/unembed/other."""
    head = model.get_output_embeddings()
    kinds = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        parents = name.split(".")[:-1]
        if module is head:
            kinds[name] = "unembed"
        elif any(p in _ATTN_PARENTS for p in parents):
            kinds[name] = "attn"
        elif any(p in _MLP_PARENTS for p in parents):
            kinds[name] = "mlp"
        else:
            kinds[name] = "other"
    return kinds


def lora_target_modules(layer_kinds: dict[str, str], lora: types.LoraConfig) -> list[str]:
    """PEFT target names for the layers `lora`'s train_* flags select.

    Leaf names ("q_proj") when they select exactly those layers (what PEFT writes and vLLM
    expects), else full module names.
    """
    wanted = {"attn": lora.train_attn, "mlp": lora.train_mlp, "unembed": lora.train_unembed}
    targets = {name for name, kind in layer_kinds.items() if wanted.get(kind, False)}
    leaves = {t.rsplit(".", 1)[-1] for t in targets}
    by_leaf = {name for name in layer_kinds if name.rsplit(".", 1)[-1] in leaves}
    return sorted(leaves) if by_leaf == targets else sorted(targets)


def validate_lora_config(lora: types.LoraConfig) -> None:
    if not 1 <= lora.rank <= MAX_LORA_RANK:
        raise InvalidRequestError("rank", f"is {lora.rank}; must be in [1, {MAX_LORA_RANK}]")
    if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
        raise InvalidRequestError(
            "train_mlp", "train_mlp, train_attn and train_unembed are all False: nothing to train"
        )


def peft_config_for(layer_kinds: dict[str, str], lora: types.LoraConfig) -> PeftLoraConfig:
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=lora_target_modules(layer_kinds, lora),
        bias="none",
        init_lora_weights=True,  # A: Kaiming-uniform, B: zero, so a new adapter starts as the base
    )


def add_lora_adapter(
    base: PreTrainedModel | PeftModel,
    layer_kinds: dict[str, str],
    adapter_name: str,
    lora: types.LoraConfig,
) -> PeftModel:
    """Add a freshly initialised adapter (seeded by `lora.seed`) and return the PEFT model.

    The first adapter wraps `base` in a `PeftModel`; later ones are added beside it.
    `layer_kinds` comes from `classify_linear_layers` on the clean base.
    Adapter weights are float32 whatever the base dtype (they are the trained parameters).
    """
    config = peft_config_for(layer_kinds, lora)
    seed = lora.seed if lora.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # LoRA on a tied lm_head adds a delta to the output projection only; PEFT's warning
        # is about merging adapters into tied weights, which we never do.
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        torch.manual_seed(seed)
        if isinstance(base, PeftModel):
            base.add_adapter(adapter_name, config)
            peft_model = base
        else:
            peft_model = get_peft_model(base, config, adapter_name=adapter_name)
    for name, param in peft_model.named_parameters():
        if f".{adapter_name}." in name:
            param.data = param.data.float()
    for module in peft_model.modules():
        if isinstance(module, BaseTunerLayer):
            # PEFT would copy every activation to float32 to meet the adapter weights; under
            # bf16 autocast the matmuls run in bf16 anyway, so the copies are pure overhead.
            module.cast_input_dtype_enabled = False
    return peft_model


def adapter_parameters(
    peft_model: PeftModel, adapter_name: str
) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable parameters of one adapter, in a stable order."""
    return [(n, p) for n, p in peft_model.named_parameters() if f".{adapter_name}." in n]
