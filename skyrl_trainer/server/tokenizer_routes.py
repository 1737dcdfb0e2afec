"""The tokenizer files of a served model, for clients on other machines.

The Tinker SDK builds a tokenizer with `AutoTokenizer.from_pretrained(tokenizer_id)`, where
`tokenizer_id` is what `get_info` names (TrainingClient) or the base model's name
(SamplingClient). That id is the model's hub id where it has one, else its public name; never
a path on this machine. A client that cannot fetch it from the Hugging Face Hub (offline, or a
local model folder served under its own name) gets the files here:
`GET /api/v1/tokenizer?base_model=NAME` answers `{base_model, tokenizer_id, files}` (file name
-> base64 contents), and `skyrl_trainer.connect.install_tokenizer` writes them into the
client's Hugging Face cache under both names, after which the SDK's `get_tokenizer()` loads
them (with `HF_HUB_OFFLINE=1` for a name the Hub does not have).
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

from fastapi import APIRouter, Depends, Request

from skyrl_trainer.server.auth import authenticate
from skyrl_trainer.server.state import ServerState

router = APIRouter(prefix="/api/v1")

# What AutoTokenizer reads from a model folder (whichever exist).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
    "generation_config.json",
)
# Keys that may hold a path on the machine that saved the folder.
_PATH_KEYS = ("_name_or_path", "name_or_path", "tokenizer_file", "vocab_file", "merges_file")


def _state(request: Request) -> ServerState:
    return request.app.state.server


def tokenizer_files(folder: Path) -> dict[str, bytes]:
    """The folder's tokenizer files; JSON files without the keys that may name a local path."""
    files = {}
    for name in TOKENIZER_FILES:
        path = folder / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if name.endswith(".json"):
            try:
                content = json.loads(data)
            except ValueError:
                content = None
            if isinstance(content, dict) and any(k in content for k in _PATH_KEYS):
                for key in _PATH_KEYS:
                    content.pop(key, None)
                data = json.dumps(content, indent=2, ensure_ascii=False).encode()
        files[name] = data
    return files


@router.get("/tokenizer")
async def get_tokenizer(base_model: str, request: Request, owner: str = Depends(authenticate)):
    state = _state(request)
    core = state.core
    name = core.base_models.resolve(base_model)  # only served models: refused by name
    folder = await asyncio.to_thread(core.model_dir, name)
    files = await asyncio.to_thread(tokenizer_files, Path(folder))
    return {
        "base_model": name,
        "tokenizer_id": core.base_models.tokenizer_id(name, name),
        "files": {n: base64.b64encode(d).decode("ascii") for n, d in files.items()},
    }
