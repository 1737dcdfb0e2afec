"""Keeping the server machine's filesystem paths out of error messages.

Answers are built from public names (`backend.base_models`) and tinker:// paths, but an error
raised deep in the backend (a damaged checkpoint folder, an engine failing to load) may name
the folder it was looking at. Every error message a caller receives passes through
`PathRedactor`, which replaces the server's own folders (storage, caches, served model
folders, the home and working folders) with `<server path>`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

HIDDEN = "<server path>"


class PathRedactor:
    def __init__(self, folders: Iterable[str | os.PathLike[str]]):
        spellings: set[str] = set()
        for folder in folders:
            text = os.fspath(folder)
            spellings |= {text.rstrip("/"), str(Path(text).expanduser().resolve())}
        # Too short to name anything specific ("/", "/tmp"): replacing them would garble text.
        kept = {s for s in spellings if s.count("/") >= 2 or (s.count("/") == 1 and len(s) > 5)}
        kept = {s for s in kept if Path(s).is_absolute() and s not in ("/tmp", "/var", "/usr")}
        self._folders = sorted(kept, key=len, reverse=True)  # longest first: no partial hits

    def __call__(self, text: str) -> str:
        for folder in self._folders:
            text = text.replace(folder, HIDDEN)
        return text


def server_folders(storage_dir: Path, cache_dir: Path, database: Path, served: list[str]):
    """The folders whose paths answers must not contain."""
    folders = [storage_dir, cache_dir, database.parent, Path.home(), Path.cwd(), sys.prefix]
    folders += [s for s in served if Path(s).expanduser().is_absolute() or Path(s).is_dir()]
    return folders
