"""In-process Tinker clients: the SDK's `ServiceClient` / `TrainingClient` surface over `BackendCore`."""

from skyrl_trainer.backend.clients.sampling_client import SamplingClient
from skyrl_trainer.backend.clients.service_client import ServiceClient
from skyrl_trainer.backend.clients.training_client import TrainingClient

__all__ = ["SamplingClient", "ServiceClient", "TrainingClient"]
