"""The one place that picks what answers the Tinker calls: the in-process backend or a remote
Tinker service. The trainer receives the `ServiceClient` and never knows which."""

from __future__ import annotations

import os
from pathlib import Path

from skyrl_trainer.trainer.config import BackendSettings, ConfigError


def make_service_client(settings: BackendSettings):
    """A Tinker `ServiceClient`: in-process (`kind=local`, configured by `settings.local`) or the
    official SDK's client for `settings.base_url` (`kind=remote`, API key from the environment)."""
    if settings.kind == "local":
        from skyrl_trainer.backend.clients import ServiceClient
        from skyrl_trainer.backend.config import backend_config_from_dict

        return ServiceClient(backend_config_from_dict(settings.local, field="backend.local"))
    if settings.kind == "remote":
        import tinker

        api_key = os.environ.get(settings.api_key_env)
        if not api_key:
            raise ConfigError(
                f"backend.api_key_env: the environment variable {settings.api_key_env} is not set; "
                "export the remote service's API key there"
            )
        return tinker.ServiceClient(base_url=settings.base_url, api_key=api_key)
    raise ConfigError(f"backend.kind: {settings.kind!r} is not one of ['local', 'remote']")


def install_tokenizer(
    base_url: str, api_key: str, base_model: str, cache_dir: str | os.PathLike | None = None
) -> str:
    """Put the tokenizer of `base_model`, as our server serves it (`GET /api/v1/tokenizer`),
    into this machine's Hugging Face hub cache (`cache_dir`, default the `HF_HUB_CACHE` in
    use), under its tokenizer id and under the model's name. The official SDK's
    `TrainingClient.get_tokenizer()` / `SamplingClient.get_tokenizer()` then load it with no
    Hub access (set `HF_HUB_OFFLINE=1` when the id is not a Hub repository). An entry the
    cache already holds for a name (e.g. downloaded from the Hub) is left alone.
    Returns the tokenizer id."""
    import base64
    import hashlib

    import httpx
    from huggingface_hub import constants

    response = httpx.get(
        f"{base_url.rstrip('/')}/api/v1/tokenizer",
        params={"base_model": base_model},
        headers={"X-API-Key": api_key},
        timeout=60,
    )
    if response.status_code != 200:
        raise ConfigError(
            f"no tokenizer for {base_model!r} from {base_url}: HTTP {response.status_code} "
            f"{response.text[:500]}"
        )
    answer = response.json()
    files = {name: base64.b64decode(data) for name, data in answer["files"].items()}
    digest = hashlib.sha1()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name])
    revision = digest.hexdigest()
    cache = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE)
    for repo_id in dict.fromkeys((answer["tokenizer_id"], answer["base_model"])):
        _write_hub_snapshot(cache, repo_id, revision, files)
    return answer["tokenizer_id"]


def _write_hub_snapshot(cache: Path, repo_id: str, revision: str, files: dict[str, bytes]):
    """`files` as the `main` revision of model repository `repo_id` in a hub cache (the
    layout huggingface_hub reads offline: refs/main -> snapshots/<revision>/<files>)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return  # not a name the SDK can load by (it would read it as a folder path)
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        current = repo / "snapshots" / ref.read_text().strip()
        if (current / "tokenizer_config.json").is_file() and not (current / _MARKER).is_file():
            return  # someone else's copy (the Hub's): keep it
    snapshot = repo / "snapshots" / revision
    if not (snapshot / _MARKER).is_file():
        snapshot.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (snapshot / name).write_bytes(data)
        (snapshot / _MARKER).write_text("written by skyrl_trainer.connect.install_tokenizer\n")
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(revision)


_MARKER = ".skyrl_tokenizer"


def training_tokenizer(training_client, base_model: str):
    """The tokenizer of the model `training_client` trains. A remote server names its models
    and never says where they live: the SDK loads the tokenizer by that name (a hub repository),
    which fails offline or for a folder the server serves under its own name. Then the
    tokenizer of `base_model` as configured here is loaded (the same model, resolved locally;
    `install_tokenizer` is for SDK programs that have no local copy)."""
    try:
        return training_client.get_tokenizer()
    except (OSError, ValueError) as sdk_error:
        from skyrl_trainer.backend.model_loading import load_tokenizer, resolve_model_dir

        try:
            return load_tokenizer(resolve_model_dir(base_model))
        except Exception as exc:
            raise ConfigError(
                f"model.base_model: no tokenizer for {base_model!r}: the service's tokenizer "
                f"could not be loaded ({sdk_error}) and {base_model!r} does not resolve here "
                f"({exc})"
            ) from exc
