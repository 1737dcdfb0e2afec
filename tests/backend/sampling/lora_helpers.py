"""A PEFT LoRA adapter folder with random factors, for the engine tests' references."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from skyrl_trainer.backend.model_loading import load_causal_lm


def make_peft_adapter(
    model_dir, folder, seed: int, *, randomize: str = "lora_", std: float = 0.3, **config
):
    """Save a PEFT LoRA adapter (r=4, alpha=8 unless `config` says otherwise) whose parameters
    named like `randomize` are drawn from N(0, std), so the adapter changes the model."""
    settings = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    settings.update(config)
    peft_model = get_peft_model(load_causal_lm(model_dir, torch.float32), LoraConfig(**settings))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if randomize in name:
                param.normal_(0, std)
    peft_model.save_pretrained(str(folder))
    return folder
