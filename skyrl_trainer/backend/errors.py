"""Errors the backend raises for requests it refuses.

Every refusal names the offending field so that a caller can fix the request without
reading backend code. A refused request never changes model state.
"""

from __future__ import annotations

from tinker import RequestFailedError
from tinker.types import RequestErrorCategory


class InvalidRequestError(RequestFailedError, ValueError):
    """A request the backend refuses because of its content (the caller's fault).

    `field` names the offending part of the request, e.g. `data[3].loss_fn_inputs.advantages`
    or `loss_fn_config.clip_low_threshold`. It is a `tinker.RequestFailedError` (category
    "user"), what the SDK raises for a failed request, so one `except` serves the in-process
    and the remote backend; and a `ValueError`.
    """

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}", request_id="", category=RequestErrorCategory.User)

    def __reduce__(self):
        return (self.__class__, (self.field, self.problem))


class NotFoundError(InvalidRequestError):
    """The request names something (a model id, a checkpoint path) that does not exist."""
