"""LoRA adapters in the PyTorch sampling engine, served from merged weight copies.

PEFT's unmerged layers add two small matmuls, a scale and an add to every adapted linear layer in
every forward; with rank 32 on all projections of SmolLM2 that halves the engine's decode rate on
CPU. So an adapter's forwards run instead on plain layers whose weight is swapped for a copy with
the adapter merged in: `W + scale * B @ A`, computed in float32 and rounded once to the engine's
dtype (the sampler/learner log-prob gap this adds is of the order of the bf16 rounding that is
there anyway). The base weights are never written, so switching back to them is exact.

Merged copies exist for the `max_merged` most recently active adapters (each costs one copy of the
weights it adapts); an adapter evicted from that cache is merged again when next used. Only the
engine loop thread calls these methods.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from skyrl_trainer.backend.errors import InvalidRequestError, NotFoundError

logger = logging.getLogger(__name__)

# PEFT's on-disk names: "base_model.model.<module>.lora_A.weight" (no adapter name).
_FACTOR_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# A whole layer weight saved beside the factors (PEFT's save_embedding_layers).
_WEIGHT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)(?:\.base_layer)?\.weight$")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass
class AdaptedLayer:
    """What an adapter does to one layer: `weight + scale * B @ A` (B @ A transposed for
    fan-in-fan-out layers), where `weight` is the base weight unless the adapter saved its own
    copy of the layer (PEFT's `save_embedding_layers`, e.g. a tied lm_head)."""

    A: torch.Tensor | None = None  # (rank, in_features)
    B: torch.Tensor | None = None  # (out_features, rank)
    scale: float = 1.0
    transpose: bool = False
    weight: torch.Tensor | None = None

    def merged_into(self, base: torch.Tensor) -> torch.Tensor:
        weight = base if self.weight is None else self.weight.to(base.device)
        merged = weight.to(torch.float32, copy=True)  # never write into the base weight
        if self.A is not None:
            A, B = self.A.to(base.device, torch.float32), self.B.to(base.device, torch.float32)
            delta = (B @ A).mul_(self.scale)
            merged = merged.add_(delta.T if self.transpose else delta)
        return merged.to(base.dtype)


def _pattern_value(module: str, patterns: dict, default):
    """PEFT's rank_pattern/alpha_pattern lookup: the first key that matches the module's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_lora_adapter(folder: Path, modules: dict[str, torch.nn.Module]) -> dict[str, AdaptedLayer]:
    """The layers a PEFT LoRA adapter folder adapts, checked against the model's `modules`.

    Raises InvalidRequestError naming what cannot be served this way (DoRA, LoRA on embeddings,
    trained biases, a layer the model lacks, factor shapes that do not fit the layer).
    """
    config = json.loads((folder / "adapter_config.json").read_text())
    for flag in ("use_dora", "modules_to_save"):
        if config.get(flag):
            raise InvalidRequestError("adapter_dir", f"{flag} adapters are not supported")
    if config.get("bias", "none") != "none":
        raise InvalidRequestError(
            "adapter_dir", f"bias={config['bias']!r}: only 'none' is supported"
        )
    weights_file = next(folder / f for f in ADAPTER_FILES if (folder / f).is_file())
    if weights_file.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(weights_file))
    else:
        tensors = torch.load(weights_file, map_location="cpu", weights_only=True)

    parts: dict[str, dict[str, torch.Tensor]] = {}  # module -> {"A", "B", "weight"}
    for key, tensor in tensors.items():
        match = _FACTOR_KEY.match(key) or _WEIGHT_KEY.match(key)
        if match is None:
            raise InvalidRequestError(
                f"adapter weights[{key!r}]", "is not a LoRA factor ('...<layer>.lora_A.weight')"
            )
        parts.setdefault(match["module"], {})[match.groupdict().get("ab") or "weight"] = tensor

    alpha = config.get("lora_alpha", 8)
    transpose = bool(config.get("fan_in_fan_out", False))
    layers = {}
    for name, part in parts.items():
        where = f"adapter weights[{name!r}]"
        module = modules.get(name)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise InvalidRequestError(where, "the model has no layer of this name")
        layer = AdaptedLayer(weight=part.get("weight"), transpose=transpose)
        if layer.weight is not None and layer.weight.shape != weight.shape:
            raise InvalidRequestError(
                where, f"has shape {tuple(layer.weight.shape)}; the layer has {tuple(weight.shape)}"
            )
        if "A" in part or "B" in part:
            _check_factors(where, part, weight.shape, transpose, module)
            layer.A, layer.B = part["A"], part["B"]
            layer_alpha = _pattern_value(name, config.get("alpha_pattern") or {}, alpha)
            rank = layer.A.shape[0]
            layer.scale = layer_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        layers[name] = layer
    if not any(layer.A is not None for layer in layers.values()):
        raise InvalidRequestError("adapter_dir", f"{str(folder)!r} holds no LoRA factors")
    return layers


def _check_factors(where: str, part: dict, shape, transpose: bool, module) -> None:
    if isinstance(module, torch.nn.Embedding):
        raise InvalidRequestError(where, "LoRA on embedding layers is not supported")
    if set(part) - {"weight"} != {"A", "B"}:
        raise InvalidRequestError(where, "needs both lora_A and lora_B")
    A, B = part["A"], part["B"]
    out_features, in_features = shape[::-1] if transpose else shape
    if A.dim() != 2 or B.dim() != 2 or B.shape != (out_features, A.shape[0]):
        raise InvalidRequestError(
            where, f"lora_B {tuple(B.shape)} does not fit lora_A {tuple(A.shape)} on this layer"
        )
    if A.shape[1] != in_features:
        raise InvalidRequestError(
            where, f"lora_A has {A.shape[1]} inputs; the layer has {in_features}"
        )


class AdapterSet:
    """LoRA adapters of the engine's model, and which one its forwards currently run with."""

    def __init__(self, model: torch.nn.Module, max_merged: int = 2):
        self.model = model
        self.max_merged = max(1, max_merged)
        self._modules = dict(model.named_modules())
        self._layers: dict[str, dict[str, AdaptedLayer]] = {}
        self.folders: dict[str, Path] = {}
        # name -> {module name: merged weight}, most recently used last
        self._merged: OrderedDict[str, dict[str, torch.nn.Parameter]] = OrderedDict()
        self._base: dict[str, torch.nn.Parameter] = {}  # base weights of swapped modules
        self._active: str | None = None

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
        if not any((folder / f).is_file() for f in ADAPTER_FILES):
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
        """Load (or replace) adapter `name` from `folder`; nothing changes if the folder is bad."""
        layers = read_lora_adapter(folder, self._modules)
        self.remove(name, missing_ok=True)
        self._layers[name] = layers
        self.folders[name] = folder

    def remove(self, name: str, missing_ok: bool = False) -> None:
        if name not in self.folders:
            if missing_ok:
                return
            raise self.unknown(name)
        if self._active == name:
            self.activate(None)
        self._merged.pop(name, None)
        del self._layers[name], self.folders[name]

    def forget_merged(self) -> None:
        """Back to the base weights, and drop every merged copy (call before the base changes)."""
        self.activate(None)
        self._merged.clear()

    def activate(self, name: str | None) -> None:
        """Make the model's forwards run with adapter `name` merged in (None: the base weights)."""
        if name == self._active:
            return
        for module_name, base in self._base.items():
            self._modules[module_name].weight = base
        self._base.clear()
        self._active = None
        if name is None:
            return
        for module_name, merged in self._merged_weights(name).items():
            module = self._modules[module_name]
            self._base[module_name] = module.weight
            module.weight = merged
        self._active = name

    def _merged_weights(self, name: str) -> dict[str, torch.nn.Parameter]:
        if name in self._merged:
            self._merged.move_to_end(name)
            return self._merged[name]
        while len(self._merged) >= self.max_merged:
            evicted, _ = self._merged.popitem(last=False)
            logger.debug(
                "dropping the merged weights of adapter %r (max_merged=%d)",
                evicted,
                self.max_merged,
            )
        with torch.no_grad():
            merged = {
                module_name: torch.nn.Parameter(
                    layer.merged_into(self._modules[module_name].weight), requires_grad=False
                )
                for module_name, layer in self._layers[name].items()
            }
        self._merged[name] = merged
        return merged
