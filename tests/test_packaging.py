"""The project metadata is valid and matches the code."""

from __future__ import annotations

import importlib
import importlib.metadata
import tomllib
from pathlib import Path

import pytest

import skyrl_trainer

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def test_pyproject_parses_and_names_the_package(pyproject):
    project = pyproject["project"]
    assert project["name"] == "skyrl-trainer"
    assert project["requires-python"] == ">=3.11"
    assert pyproject["tool"]["setuptools"]["packages"]["find"]["include"] == ["skyrl_trainer*"]
    dependencies = " ".join(project["dependencies"])
    for needed in ("torch", "transformers", "tinker==0.38.*", "hydra-core", "gguf", "safetensors"):
        assert needed in dependencies
    assert set(project["optional-dependencies"]) >= {"dev", "vllm", "model"}


def test_package_imports_with_its_version():
    assert skyrl_trainer.__version__
    importlib.import_module("skyrl_trainer.backend.errors")
    importlib.import_module("skyrl_trainer.backend.model_loading")
    try:
        installed = importlib.metadata.version("skyrl-trainer")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("skyrl-trainer is not pip-installed here (run `make setup`)")
    assert installed == skyrl_trainer.__version__


def test_pytest_markers_are_registered(pytestconfig):
    registered = {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}
    assert {"gpu", "slow", "vllm"} <= registered


@pytest.mark.gpu
def test_gpu_marked_tests_run_only_with_a_cuda_gpu():
    import torch

    assert torch.cuda.is_available()  # skipped by tests/conftest.py otherwise


@pytest.mark.vllm
def test_vllm_marked_tests_run_only_with_vllm():
    importlib.import_module("vllm")  # skipped by tests/conftest.py otherwise
