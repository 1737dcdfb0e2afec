"""Where training and evaluation rows come from: a local file, a local folder, or a hub dataset.

`load_rows(source, split)` accepts what a user writes in `data.path` (train) or `data.eval_path` (eval):

1. A local file (`.jsonl`, `.json`, `.parquet`): all its rows, whatever `split` is (one file is one split).
2. A local folder: the file(s) of that split, first match wins: `<split>.jsonl`, `<split>.json`,
   `<split>.parquet`, then the shards `<split>-*.parquet` (the Hugging Face hub layout).
3. A hub id (`owner/name`), optionally with a config name after a colon (`openai/gsm8k:main`), loaded with
   `datasets.load_dataset(id, config, split=split)`; it honours `HF_DATASETS_OFFLINE` and the local cache.
   A missing path that cannot be a hub id (starts with ".", "/" or "~", has a file suffix, or has more
   than one "/") is reported as a missing file or folder.

Every failure is a `ValueError` whose message starts with the config field (`field`) and says what to do.
"""

from __future__ import annotations

import re
from pathlib import Path

import datasets
import pyarrow.parquet as pq

#: Local file suffixes and the `datasets` builder that reads them.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

# owner/name[:config] or a bare legacy name[:config]; anything with more slashes is a path.
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?(:[\w.-]+)?$")
# The `-00000-of-00003` part of a hub shard name, stripped to list a folder's splits.
_SHARD_SUFFIX = re.compile(r"-\d+-of-\d+$")


def load_rows(
    source: str, split: str, field: str = "data.path", required: tuple[str, ...] = ()
) -> list[dict]:
    """Load the rows of `split` from `source` as a list of plain dicts.

    Raises ValueError, naming `field`, when the file or folder does not exist, the folder has no such
    split, the hub dataset cannot be loaded (e.g. offline and not cached), there are no rows, or a column
    in `required` is missing.
    """
    if not source or not source.strip():
        raise ValueError(
            f"{field} is empty: give a .jsonl/.json/.parquet file, a folder, or a hub id"
        )
    path = Path(source).expanduser()
    if path.is_file():
        dataset = _load_files(_builder_for(path, field), [path], source, field)
    elif path.is_dir():
        builder, files = _split_files(path, split, field)
        dataset = _load_files(builder, files, source, field)
    elif _looks_local(source):
        raise ValueError(
            f"{field}: no such file or folder: {source!r}. Fix the path, or give a hub id "
            "such as 'openai/gsm8k:main'."
        )
    else:
        dataset = _load_hub(source, split, field)

    where = f"{source!r} (split {split!r})"
    if len(dataset) == 0:
        raise ValueError(f"{field}: {where} has no rows; point {field} at a non-empty dataset")
    missing = [column for column in required if column not in dataset.column_names]
    if missing:
        raise ValueError(
            f"{field}: {where} has no column(s) {missing}; its columns are {dataset.column_names}. "
            "Rename the columns in the data or choose the columns in the task config "
            "(question_key / answer_key)."
        )
    return dataset.to_list()


def _looks_local(source: str) -> bool:
    return (
        source.startswith((".", "/", "~"))
        or Path(source).suffix.lower() in FILE_BUILDERS
        or not _HUB_ID.match(source)
    )


def _builder_for(path: Path, field: str) -> str:
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(
            f"{field}: {str(path)!r} is not a .jsonl, .json or .parquet file; convert it to one of these"
        )
    return builder


def _split_files(folder: Path, split: str, field: str) -> tuple[str, list[Path]]:
    for name in (f"{split}.jsonl", f"{split}.json", f"{split}.parquet"):
        if (folder / name).is_file():
            return _builder_for(folder / name, field), [folder / name]
    shards = sorted(p for p in folder.glob(f"{split}-*.parquet") if p.is_file())
    if shards:
        return "parquet", shards
    present = sorted(
        {
            _SHARD_SUFFIX.sub("", p.stem)
            for p in folder.iterdir()
            if p.is_file() and p.suffix.lower() in FILE_BUILDERS
        }
    )
    raise ValueError(
        f"{field}: folder {str(folder)!r} has no {split!r} split (looked for {split}.jsonl, "
        f"{split}.json, {split}.parquet and {split}-*.parquet); splits found: {present or 'none'}. "
        f"Add the file, or point {field} at a file."
    )


def _load_files(builder: str, files: list[Path], source: str, field: str) -> datasets.Dataset:
    if all(_holds_no_rows(builder, f) for f in files):
        # `datasets` fails on these with unhelpful errors (StopIteration, "corresponds to no data").
        raise ValueError(f"{field}: {source!r} has no rows; point {field} at a non-empty dataset")
    try:
        # A local file set has a single split, which `datasets` calls "train".
        return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
    except Exception as error:
        raise ValueError(
            f"{field}: could not read {source!r} as {builder}: {type(error).__name__}: {error}"
        ) from error


def _holds_no_rows(builder: str, path: Path) -> bool:
    if builder == "parquet":
        try:
            return pq.read_metadata(path).num_rows == 0
        except Exception:
            return False  # unreadable: `datasets` reports it
    # Only tiny JSON files can be empty ("", "[]"); reading large ones here would cost time.
    return path.stat().st_size < 64 and path.read_text(errors="replace").strip() in ("", "[]")


def _load_hub(source: str, split: str, field: str) -> datasets.Dataset:
    repo, _, config = source.partition(":")
    name = f"{repo!r}" + (f" (config {config!r})" if config else "")
    try:
        return datasets.load_dataset(repo, config or None, split=split)
    except (ConnectionError, FileNotFoundError) as error:
        # Offline without a cached copy raises ConnectionError; an unknown id FileNotFoundError.
        raise ValueError(
            f"{field}: no local file or folder {source!r}, and could not load the hub dataset "
            f"{name}: {error}. If there is no network: "
            "download it once or give a local path (a .jsonl/.json/.parquet file or a folder)."
        ) from error
    except ValueError as error:
        # Unknown split, or a config name that is missing or wrong.
        raise ValueError(
            f"{field}: the hub dataset {name} has no split {split!r} or needs another config: "
            f"{error}. Name the config as '{repo}:<config>'."
        ) from error
