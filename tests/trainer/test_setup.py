"""The trainer's model settings reach the backend (`trainer/setup.py`)."""

from __future__ import annotations

import json

import pytest

from skyrl_trainer.trainer.setup import training_client
from tests.trainer.loop_helpers import make_config, make_service


@pytest.mark.parametrize("train_unembed", [False, True])
def test_lora_adapts_lm_head_only_when_train_unembed(tmp_path, tiny_model_dir, train_unembed):
    cfg = make_config(
        tmp_path, tiny_model_dir, "arithmetic", **{"model.train_unembed": train_unembed}
    )
    service = make_service(tmp_path)
    try:
        tc = training_client(cfg, service, resume=None)
        folder, _ = service.core.store.resolve(tc.save_state("adapter").result().path)
        targets = json.loads((folder / "adapter_config.json").read_text())["target_modules"]
    finally:
        service.core.shutdown()
    assert ("lm_head" in targets) is train_unembed
    assert {"q_proj", "down_proj"} <= set(targets)  # attention and MLP always
