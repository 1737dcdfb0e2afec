"""Which base models a backend accepts, and under which names (backend/base_models.py)."""

from __future__ import annotations

import pytest

from skyrl_trainer.backend.base_models import BaseModelCatalog, parse_served_model
from skyrl_trainer.backend.errors import InvalidRequestError


def test_public_names(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert parse_served_model(str(folder)).name == "my-model"
    assert parse_served_model(f"alias={folder}").name == "alias"
    packaged = parse_served_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert packaged.name == "SmolLM2-135M-Instruct"
    assert packaged.tokenizer_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    hub = parse_served_model("Qwen/Qwen3-4B-Instruct-2507")
    assert (hub.name, hub.source, hub.tokenizer_id) == ("Qwen/Qwen3-4B-Instruct-2507",) * 3


def test_served_only_refuses_everything_else_by_name(tmp_path):
    folder = tmp_path / "served"
    folder.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    catalog = BaseModelCatalog([str(folder), "SmolLM2-135M-Instruct"], served_only=True)
    assert catalog.names == ["served", "SmolLM2-135M-Instruct"]
    for name in ("served", str(folder), str(folder.resolve())):
        assert catalog.resolve(name) == "served"
    assert catalog.source("served") == str(folder)
    assert catalog.resolve("huggingfacetb/smollm2-135m-instruct") == "SmolLM2-135M-Instruct"
    for name in (str(other), "other", f"{folder}/../other", "gpt2", "../served"):
        with pytest.raises(InvalidRequestError, match="not served here") as info:
            catalog.resolve(name)
        assert info.value.field == "base_model"
        assert "this server serves: 'served', 'SmolLM2-135M-Instruct'" in str(info.value)
    with pytest.raises(InvalidRequestError, match="non-empty"):
        catalog.resolve("")


def test_in_process_accepts_any_name_canonically(tmp_path):
    catalog = BaseModelCatalog(["SmolLM2-135M-Instruct"], served_only=False)
    assert catalog.resolve(str(tmp_path)) == str(tmp_path.resolve())
    assert catalog.resolve("HuggingFaceTB/SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    assert catalog.resolve("org/any") == "org/any"
    assert catalog.source("org/any") == "org/any"


def test_server_list_errors_name_the_fix(tmp_path):
    (tmp_path / "a" / "m").mkdir(parents=True)
    (tmp_path / "b" / "m").mkdir(parents=True)
    with pytest.raises(ValueError, match="NAME=SOURCE"):
        BaseModelCatalog([str(tmp_path / "a" / "m"), str(tmp_path / "b" / "m")], True)
    with pytest.raises(ValueError, match="at least one"):
        BaseModelCatalog([], served_only=True)
    with pytest.raises(ValueError, match="names no model"):
        BaseModelCatalog(["x="], served_only=True)
