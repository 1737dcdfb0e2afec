"""Which base models a backend serves, under which public names.

In-process (the default), any name `model_loading.resolve_model_dir` can load is accepted,
and a model is known by its canonical name (`canonical_model_name`). A backend behind the
HTTP server serves only the models it was started with (`served_only=True`): every other
name is refused with the list, so a caller can neither make the server load an arbitrary
folder or hub repository nor learn anything about its disk. Each served model has a public
name, the only name responses use:

- `NAME=SOURCE`: NAME (SOURCE is a folder, packaged name or hub id);
- a packaged model name or its hub id: the packaged name;
- a local folder: the folder's own name (its last path component), never its path;
- a hub id: the hub id.

A request may name a served model by its public name or by the entry as the operator wrote it
(and a packaged model by its hub id too). Names are compared as strings: a caller's name never
touches the filesystem.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from skyrl_trainer.backend import model_loading
from skyrl_trainer.backend.errors import InvalidRequestError


def canonical_model_name(name: str) -> str:
    """One key per base model: packaged aliases collapse to the packaged name, local folders
    to their resolved path, anything else (hub ids) stays as given."""
    packaged = model_loading.find_packaged_model(name)
    if packaged is not None:
        return packaged.name
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else name


@dataclass(frozen=True)
class ServedModel:
    name: str
    """The public name: what responses say and what `resolve` returns."""
    source: str
    """What `model_loading.resolve_model_dir` loads: a folder, packaged name or hub id."""
    tokenizer_id: str
    """What a client loads the tokenizer from (`get_info`): the hub id where there is one."""
    aliases: frozenset[str]
    """Every name a request may use for it."""


def parse_served_model(entry: str) -> ServedModel:
    """One `--base-model` entry (see the module docstring)."""
    entry = entry.strip()
    name, sep, source = entry.partition("=")
    if not sep:
        name, source = "", entry
    name, source = name.strip(), source.strip()
    if not source:
        raise ValueError(f"base_models: {entry!r} names no model; give NAME=SOURCE or SOURCE")
    packaged = model_loading.find_packaged_model(source)
    canonical = canonical_model_name(source)
    folder = Path(canonical) if Path(canonical).is_absolute() else None
    if not name:
        if packaged is not None:
            name = packaged.name
        elif folder is not None:
            name = folder.name
        else:
            name = source
    tokenizer_id = packaged.hub_id if packaged is not None and name == packaged.name else name
    aliases = {name, source, canonical}
    if packaged is not None:
        aliases |= {packaged.name, packaged.hub_id}
    return ServedModel(name, source, tokenizer_id, frozenset(aliases))


class BaseModelCatalog:
    """The public name of a requested base model, and the source each name loads from."""

    def __init__(self, entries: list[str], served_only: bool):
        self.served_only = served_only
        self.served = [parse_served_model(e) for e in entries] if served_only else []
        names = [m.name for m in self.served]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"base_models: the public name {duplicates[0]!r} is given to two models; name "
                "them apart with NAME=SOURCE"
            )
        if served_only and not self.served:
            raise ValueError("base_models: a server needs at least one model to serve")
        self._by_alias: dict[str, ServedModel] = {}
        for model in self.served:
            for alias in model.aliases:
                self._by_alias.setdefault(alias, model)
                self._by_alias.setdefault(alias.lower(), model)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.served]

    def resolve(self, name: object, field: str = "base_model") -> str:
        """The name the backend knows `name`'s model by (refused if it is not served)."""
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequestError(field, "must be a non-empty model name")
        if not self.served_only:
            return canonical_model_name(name)
        model = self._served(name)
        if model is None:
            served = ", ".join(repr(n) for n in self.names)
            raise InvalidRequestError(
                field, f"{name!r} is not served here; this server serves: {served}"
            )
        return model.name

    def source(self, name: str) -> str:
        """What to load for the known name `name` (from `resolve`)."""
        model = self._served(name)
        return model.source if model is not None else name

    def tokenizer_id(self, name: str, model_dir: str) -> str:
        """What `get_info` tells a client to load the tokenizer from."""
        model = self._served(name)
        return model.tokenizer_id if model is not None else model_dir

    def _served(self, name: str) -> ServedModel | None:
        if not self.served_only:
            return None
        model = self._by_alias.get(name) or self._by_alias.get(name.lower())
        if model is None:
            packaged = model_loading.find_packaged_model(name)  # a pure name look-up
            if packaged is not None:
                model = self._by_alias.get(packaged.name)
        return model
