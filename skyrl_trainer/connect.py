"""The one place that picks what answers the Tinker calls: the in-process backend or a remote
Tinker service. The trainer receives the `ServiceClient` and never knows which."""

from __future__ import annotations

import os

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


def training_tokenizer(training_client, base_model: str):
    """The tokenizer of the model `training_client` trains. A remote server names its models
    and never says where they live: the SDK loads the tokenizer by that name (a hub repository),
    which fails offline or for a folder the server serves under its own name. Then the
    tokenizer of `base_model` as configured here is loaded (the same model, resolved locally)."""
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
