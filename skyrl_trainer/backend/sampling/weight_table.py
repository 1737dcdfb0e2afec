"""A sampling engine's base weights by name, updated in place (the PyTorch and vLLM engines).

`WeightTable` maps Hugging Face parameter names to the model's parameters (with `lm_head.weight` as
an alias of the input embedding when they are tied) and checks a whole update before copying any
of it. Only the engine loop thread applies updates. (LoRA adapters: `torch_lora`.)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from skyrl_trainer.backend.errors import InvalidRequestError


class WeightTable:
    """The model's parameters by Hugging Face name, for in-place weight updates."""

    def __init__(self, model: torch.nn.Module):
        self.params = dict(model.named_parameters())
        self.aliases: dict[str, str] = {}
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and inp is not None and out.weight is inp.weight:
            canonical = next(n for n, p in self.params.items() if p is inp.weight)
            out_name = next(n for n, m in model.named_modules() if m is out) + ".weight"
            if out_name != canonical:
                self.aliases[out_name] = canonical

    def plan(
        self, named_tensors: Mapping[str, torch.Tensor]
    ) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Check every tensor (name, type, shape) and return (parameter, tensor) pairs to copy.

        Raises InvalidRequestError (a ValueError) naming the first bad tensor; nothing is copied.
        A tied output embedding given under both names is copied once, from its own name.
        """
        if not isinstance(named_tensors, Mapping):
            raise InvalidRequestError(
                "named_tensors", f"is a {type(named_tensors).__name__}, not a name -> tensor dict"
            )
        chosen: dict[str, tuple[str, torch.Tensor]] = {}
        for name, tensor in named_tensors.items():
            where = f"named_tensors[{name!r}]"
            canonical = self.aliases.get(name, name)
            param = self.params.get(canonical)
            if param is None:
                example = next(iter(self.params), "")
                raise InvalidRequestError(
                    where, f"the model has no parameter of this name (names look like {example!r})"
                )
            if not isinstance(tensor, torch.Tensor):
                raise InvalidRequestError(where, f"is a {type(tensor).__name__}, not a tensor")
            if not tensor.is_floating_point():
                raise InvalidRequestError(where, f"has dtype {tensor.dtype}; weights are floats")
            if tuple(tensor.shape) != tuple(param.shape):
                raise InvalidRequestError(
                    where,
                    f"has shape {tuple(tensor.shape)}; the parameter has shape {tuple(param.shape)}",
                )
            if canonical not in chosen or name == canonical:
                chosen[canonical] = (name, tensor)
        return [(self.params[canonical], tensor) for canonical, (_, tensor) in chosen.items()]

    @staticmethod
    def apply(plan: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        with torch.no_grad():
            for param, tensor in plan:
                param.copy_(tensor)
