"""Merged LoRA serving (`torch_lora.AdapterSet`) against PEFT's own unmerged forward (fp32)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from skyrl_trainer.backend.errors import InvalidRequestError
from skyrl_trainer.backend.model_loading import load_causal_lm
from skyrl_trainer.backend.sampling.torch_lora import AdapterSet
from tests.backend.sampling.lora_helpers import make_peft_adapter

IDS = torch.tensor([[504, 2365, 6354, 16438, 30, 7]])
TOL = {
    "atol": 1e-4,
    "rtol": 1e-4,
}  # fp32 merged vs unmerged: summation order only; adapters move logits > 1e-2


@torch.no_grad()
def peft_logits(model_dir, adapter_dir, base_state=None) -> torch.Tensor:
    base = load_causal_lm(model_dir, torch.float32)
    if base_state is not None:
        base.load_state_dict(base_state)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()(IDS).logits


@torch.no_grad()
def logits_with(adapters: AdapterSet, name: str | None) -> torch.Tensor:
    adapters.activate(name)
    return adapters.model(IDS).logits


@pytest.fixture
def model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir, torch.float32)


@pytest.mark.parametrize(
    "lora_kwargs",
    [
        {},
        {"use_rslora": True, "target_modules": ["k_proj", "gate_proj", "lm_head"]},
        {"rank_pattern": {"v_proj": 2}, "alpha_pattern": {"down_proj": 3}},
    ],
    ids=["plain", "rslora+tied-lm_head", "rank/alpha patterns"],
)
def test_merged_forward_equals_peft(tiny_model_dir, model, tmp_path, lora_kwargs):
    folder = make_peft_adapter(tiny_model_dir, tmp_path / "a", seed=1, **lora_kwargs)
    expected = peft_logits(tiny_model_dir, folder)
    plain = model(IDS).logits.detach()
    assert (expected - plain).abs().max() > 1e-2  # the adapter matters

    adapters = AdapterSet(model)
    adapters.load("a", folder)
    torch.testing.assert_close(logits_with(adapters, "a"), expected, **TOL)
    assert torch.equal(logits_with(adapters, None), plain)  # the base weights were not written


def test_switching_and_eviction_keep_every_adapter_exact(tiny_model_dir, model, tmp_path):
    folders = {
        "a": make_peft_adapter(tiny_model_dir, tmp_path / "a", seed=1),
        "b": make_peft_adapter(tiny_model_dir, tmp_path / "b", seed=2, target_modules=["o_proj"]),
    }
    expected = {name: peft_logits(tiny_model_dir, f) for name, f in folders.items()}
    with torch.no_grad():
        expected[None] = model(IDS).logits
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    adapters = AdapterSet(model, max_merged=1)
    for name, folder in folders.items():
        adapters.load(name, folder)
    for name in ["a", "b", "a", None, "b", "b", None, "a"]:
        got = logits_with(adapters, name)
        torch.testing.assert_close(got, expected[name], **TOL)
        assert len(adapters._merged) <= 1
    adapters.activate(None)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in base_state.items())

    adapters.remove("a")
    torch.testing.assert_close(logits_with(adapters, "b"), expected["b"], **TOL)
    assert "a" not in adapters and "a" not in adapters._merged


def test_merged_copies_follow_a_new_base(tiny_model_dir, model, tmp_path):
    """After forget_merged (what update_weights calls), an adapter merges onto the new base."""
    folder = make_peft_adapter(tiny_model_dir, tmp_path / "a", seed=1)
    adapters = AdapterSet(model)
    adapters.load("a", folder)
    logits_with(adapters, "a")
    adapters.forget_merged()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.1)
    new_base = {k: v.clone() for k, v in model.state_dict().items()}
    expected = peft_logits(tiny_model_dir, folder, base_state=new_base)
    torch.testing.assert_close(logits_with(adapters, "a"), expected, **TOL)


def test_bad_adapters_are_refused_and_change_nothing(tiny_model_dir, model, tmp_path):
    good = make_peft_adapter(tiny_model_dir, tmp_path / "good", seed=1)
    adapters = AdapterSet(model)
    adapters.load("a", good)
    expected = logits_with(adapters, "a")

    dora = make_peft_adapter(tiny_model_dir, tmp_path / "dora", seed=2, use_dora=True)
    with pytest.raises(InvalidRequestError, match="use_dora"):
        adapters.load("a", dora)

    from safetensors.torch import load_file, save_file

    wrong = make_peft_adapter(tiny_model_dir, tmp_path / "wrong", seed=3)
    tensors = load_file(str(wrong / "adapter_model.safetensors"))
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = torch.zeros(4, 7)
    save_file(tensors, str(wrong / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequestError, match=r"layers\.0\.self_attn\.q_proj.*lora_A has 7"):
        adapters.load("a", wrong)

    renamed = make_peft_adapter(tiny_model_dir, tmp_path / "renamed", seed=4)
    tensors = load_file(str(renamed / "adapter_model.safetensors"))
    tensors = {k.replace("layers.0.", "layers.9."): v for k, v in tensors.items()}
    save_file(tensors, str(renamed / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequestError, match=r"layers\.9\..*no layer of this name"):
        adapters.load("a", renamed)

    torch.testing.assert_close(logits_with(adapters, "a"), expected, atol=0, rtol=0)
