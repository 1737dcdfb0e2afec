"""Errors the backend raises for requests it refuses.

Every refusal names the offending field so that a caller can fix the request without
reading backend code. A refused request never changes model state.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the backend refuses because of its content (the caller's fault).

    `field` names the offending part of the request, e.g. `data[3].loss_fn_inputs.advantages`
    or `loss_fn_config.clip_low_threshold`.
    """

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class NotFoundError(InvalidRequestError):
    """The request names something (a model id, a checkpoint path) that does not exist."""
