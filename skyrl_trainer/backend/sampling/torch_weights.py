"""The PyTorch sampling engine's weights: in-place base updates by name, and LoRA adapters.

`WeightTable` maps Hugging Face parameter names to the model's parameters (with `lm_head.weight` as
an alias of the input embedding when they are tied) and checks a whole update before copying any
of it. `AdapterSet` keeps PEFT LoRA adapters injected into the same model and switches between
them (or off, for base-weight requests). Both are only mutated by the engine loop thread.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from skyrl_trainer.backend.errors import InvalidRequestError, NotFoundError

_UNSET = object()


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


class AdapterSet:
    """PEFT LoRA adapters injected into the engine's model, and which one is switched on."""

    def __init__(self, model: torch.nn.Module):
        self.model = model  # the Hugging Face model; PEFT modifies it in place
        self.peft = None  # the PeftModel wrapping it while any adapter is loaded
        self.folders: dict[str, Path] = {}
        self._active: object = _UNSET  # adapter name switched on, None = all off

    def __contains__(self, name: object) -> bool:
        return name in self.folders

    def unknown(self, name: str) -> NotFoundError:
        loaded = ", ".join(repr(n) for n in self.folders) or "none"
        return NotFoundError(
            "adapter",
            f"no LoRA adapter named {name!r} is loaded (loaded: {loaded}); add_lora it first",
        )

    @staticmethod
    def check_folder(name: str, adapter_dir: str | Path) -> Path:
        """The adapter folder, if it looks like a PEFT LoRA adapter; InvalidRequestError if not."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("name", f"is {name!r}; an adapter name is a non-empty string")
        folder = Path(adapter_dir)
        config_file = folder / "adapter_config.json"
        if not config_file.is_file():
            raise InvalidRequestError("adapter_dir", f"{str(folder)!r} has no adapter_config.json")
        if not any(
            (folder / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")
        ):
            raise InvalidRequestError(
                "adapter_dir", f"{str(folder)!r} has no adapter_model.safetensors"
            )
        try:
            peft_type = json.loads(config_file.read_text()).get("peft_type")
        except (OSError, ValueError, AttributeError) as exc:
            raise InvalidRequestError(
                "adapter_dir", f"unreadable adapter_config.json: {exc}"
            ) from exc
        if str(peft_type).upper() != "LORA":
            raise InvalidRequestError("adapter_dir", f"peft_type is {peft_type!r}, not 'LORA'")
        return folder

    def load(self, name: str, folder: Path) -> None:
        """Load (or replace) adapter `name` from `folder`."""
        from peft import PeftModel

        self._active = _UNSET
        if name in self.folders and len(self.folders) == 1:
            self._unload()
        elif name in self.folders:
            self.peft.delete_adapter(name)
            del self.folders[name]
        if self.peft is None:
            self.peft = PeftModel.from_pretrained(
                self.model, str(folder), adapter_name=name, is_trainable=False
            )
        else:
            self.peft.load_adapter(str(folder), adapter_name=name, is_trainable=False)
        self.peft.eval()
        self.folders[name] = folder

    def remove(self, name: str) -> None:
        if name not in self.folders:
            raise self.unknown(name)
        self._active = _UNSET
        if len(self.folders) == 1:
            self._unload()
        else:
            self.peft.delete_adapter(name)
            del self.folders[name]

    def _unload(self) -> None:
        """Take all LoRA layers out of the model (the base parameters are untouched)."""
        self.model = self.peft.unload()
        self.peft = None
        self.folders.clear()

    def activate(self, name: str | None) -> None:
        """Switch adapter `name` on for the next forwards (None: base weights only)."""
        if self.peft is None or name == self._active:
            return
        if name is None:
            self.peft.base_model.disable_adapter_layers()
        else:
            self.peft.base_model.enable_adapter_layers()
            self.peft.set_adapter(name, inference_mode=True)
        self._active = name
