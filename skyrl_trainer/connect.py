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
