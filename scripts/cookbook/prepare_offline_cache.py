"""Pre-fill a Hugging Face cache folder so the tinker-cookbook loops run with no network.

Run with the cookbook venv's python (it needs `datasets`), by scripts/cookbook/setup_cookbook.sh.
Everything lands under HF_HOME (the folder given by --hf-home); the loops and, optionally, our server
are then run with HF_HOME=<that folder> HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1.

What it writes (idempotent: an entry whose inputs did not change is left alone):

* Hub cache, `<hf-home>/hub/models--<org>--<name>/{refs/main, snapshots/<hash>/...}`, for every repo id
  given with --repo-id: the tokenizer, config and chat template of our local SmolLM2-135M-Instruct folder,
  plus its weights (a hard link, or a symlink across file systems; --no-weights leaves them out).
  `tinker_cookbook.tokenizer_utils.get_tokenizer(<repo id>)` then loads SmolLM2's tokenizer offline, and
  `huggingface_hub.snapshot_download(<repo id>)` (what our server's model loading calls for a hub id)
  returns a folder with the SmolLM2 weights.
* `datasets` cache, `<hf-home>/datasets/openai___gsm8k/main/0.0.0/<hash>/`: GSM8K (question/answer,
  train + test) built from the local jsonl copy. Offline, `datasets.load_dataset("openai/gsm8k", "main")`
  falls back to this cache (datasets' CachedDatasetModuleFactory + the "cache" builder).
* `datasets` cache, `<hf-home>/datasets/HuggingFaceH4___no_robots/default/0.0.0/<hash>/`: a stand-in for
  HuggingFaceH4/no_robots in its schema (prompt, prompt_id, messages=[{content, role}], category), made
  from GSM8K: one user turn (the question) and one assistant turn (the worked answer) per row. It is NOT
  the real No Robots data, which cannot be fetched here.
* The same for Anthropic/hh-rlhf (the DPO recipe's `hhh` dataset: chosen = the GSM8K worked answer,
  rejected = the next question's answer) and zwhe99/DeepMath-103K (on-policy distillation's `deepmath`
  prompts: the GSM8K questions). Stand-ins too, not the real data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Bump to rebuild every entry when what this script writes changes.
FORMAT_VERSION = "1"

# Files copied from the model folder into each hub snapshot (the ones absent there are skipped).
MODEL_SMALL_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]
WEIGHT_FILES = ["model.safetensors"]


def log(msg: str) -> None:
    print(f"[prepare_offline_cache] {msg}", flush=True)


def _sha1_files(paths: list[Path], extra: str) -> str:
    h = hashlib.sha1()
    h.update(f"format={FORMAT_VERSION};{extra}".encode())
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def _link_or_copy(src: Path, dst: Path) -> str:
    try:
        os.link(src, dst)
        return "hard link"
    except OSError:
        os.symlink(src.resolve(), dst)
        return "symlink"


def prepare_hub_repo(hub_dir: Path, repo_id: str, model_dir: Path, with_weights: bool) -> None:
    small = [model_dir / f for f in MODEL_SMALL_FILES if (model_dir / f).is_file()]
    for required in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if not (model_dir / required).is_file():
            sys.exit(f"{model_dir} has no {required}: not a SmolLM2 Hugging Face folder")
    weights = (
        [model_dir / f for f in WEIGHT_FILES if (model_dir / f).is_file()] if with_weights else []
    )
    if with_weights and not weights:
        sys.exit(f"{model_dir} has no {WEIGHT_FILES}; pass --no-weights for a tokenizer-only cache")
    # The weights enter the hash by size and the conversion marker (hashing 0.5 GB on every run is slow).
    marker = model_dir / "skyrl_conversion.json"
    extra = f"repo={repo_id};weights=" + ",".join(f"{w.name}:{w.stat().st_size}" for w in weights)
    snapshot_hash = _sha1_files(small + ([marker] if marker.is_file() else []), extra)

    repo_dir = hub_dir / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    target = snapshots / snapshot_hash
    ref = repo_dir / "refs" / "main"
    if target.is_dir() and ref.is_file() and ref.read_text().strip() == snapshot_hash:
        log(f"hub cache for {repo_id} is up to date ({target})")
        return
    snapshots.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=snapshots))
    for f in small:
        shutil.copy2(f, tmp / f.name)
    how = ""
    for w in weights:
        how = _link_or_copy(w, tmp / w.name)
    if target.exists():
        shutil.rmtree(target)
    os.rename(tmp, target)
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(snapshot_hash)  # no trailing newline, as huggingface_hub writes it
    for stale in snapshots.iterdir():
        if stale.name != snapshot_hash:
            shutil.rmtree(stale, ignore_errors=True)
    log(
        f"hub cache for {repo_id}: {target} "
        f"({', '.join(f.name for f in small)}{'; weights as ' + how if weights else '; no weights'})"
    )


def _build_dataset(
    datasets_dir: Path,
    repo_id: str,
    config_name: str,
    data_files: dict[str, str],
    features,
    source_hash: str,
) -> None:
    """Write a `datasets` cache entry exactly where load_dataset(repo_id, config_name) looks offline."""
    from datasets.packaged_modules.json.json import Json

    namespace, name = repo_id.split("/")
    from datasets.naming import camelcase_to_snakecase

    dataset_name = camelcase_to_snakecase(name)
    version_dir = datasets_dir / f"{namespace}___{dataset_name}" / config_name / "0.0.0"
    target = version_dir / source_hash
    if (target / "dataset_info.json").is_file():
        log(f"datasets cache for {repo_id} ({config_name}) is up to date ({target})")
        return
    version_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tmp-build-", dir=version_dir) as scratch:
        out = Path(scratch) / "out"
        builder = Json(
            cache_dir=str(Path(scratch) / "builder"),
            dataset_name=dataset_name,
            config_name=config_name,
            data_files=data_files,
            features=features,
        )
        builder.download_and_prepare(output_dir=str(out))
        info = json.loads((out / "dataset_info.json").read_text())
        assert info["config_name"] == config_name and info["dataset_name"] == dataset_name, info
        for lock in out.parent.glob("out*.lock"):
            lock.unlink()
        if target.exists():
            shutil.rmtree(target)
        os.rename(out, target)
    for stale in version_dir.iterdir():
        if stale.name != source_hash:
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
    splits = {k: v["num_examples"] for k, v in info["splits"].items()}
    log(f"datasets cache for {repo_id} ({config_name}): {target} {splits}")


def prepare_gsm8k(datasets_dir: Path, gsm8k_dir: Path) -> None:
    import datasets

    files = {s: gsm8k_dir / f"{s}.jsonl" for s in ("train", "test")}
    for f in files.values():
        if not f.is_file():
            sys.exit(f"missing {f} (GSM8K jsonl with question/answer)")
    features = datasets.Features(
        {"question": datasets.Value("string"), "answer": datasets.Value("string")}
    )
    _build_dataset(
        datasets_dir,
        "openai/gsm8k",
        "main",
        {s: str(f) for s, f in files.items()},
        features,
        _sha1_files(list(files.values()), "gsm8k"),
    )


def prepare_no_robots_standin(datasets_dir: Path, gsm8k_dir: Path) -> None:
    import datasets

    files = {s: gsm8k_dir / f"{s}.jsonl" for s in ("train", "test")}
    source_hash = _sha1_files(list(files.values()), "no_robots-from-gsm8k")
    with tempfile.TemporaryDirectory(prefix="no_robots_src-") as tmp:
        data_files = {}
        for split, src in files.items():
            dst = Path(tmp) / f"{split}.jsonl"
            with src.open() as fin, dst.open("w") as fout:
                for line in fin:
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    q, a = row["question"], row["answer"]
                    fout.write(
                        json.dumps(
                            {
                                "prompt": q,
                                "prompt_id": hashlib.sha256(q.encode()).hexdigest(),
                                "messages": [
                                    {"content": q, "role": "user"},
                                    {"content": a, "role": "assistant"},
                                ],
                                "category": "Closed QA",
                            }
                        )
                        + "\n"
                    )
            data_files[split] = str(dst)
        features = datasets.Features(
            {
                "prompt": datasets.Value("string"),
                "prompt_id": datasets.Value("string"),
                "messages": datasets.List(
                    {"content": datasets.Value("string"), "role": datasets.Value("string")}
                ),
                "category": datasets.Value("string"),
            }
        )
        _build_dataset(
            datasets_dir, "HuggingFaceH4/no_robots", "default", data_files, features, source_hash
        )


def _write_standin(
    datasets_dir: Path,
    gsm8k_dir: Path,
    repo_id: str,
    config_name: str,
    features,
    rows_for_split,  # (split name, list of GSM8K rows) -> list of stand-in rows
    tag: str = "",  # change it when rows_for_split changes, to rebuild the entry
) -> None:
    """A `datasets` cache entry for repo_id built from the GSM8K jsonl files by rows_for_split."""
    files = {s: gsm8k_dir / f"{s}.jsonl" for s in ("train", "test")}
    source_hash = _sha1_files(list(files.values()), f"{repo_id}-from-gsm8k{tag}")
    with tempfile.TemporaryDirectory(prefix="standin_src-") as tmp:
        data_files = {}
        for split, src in files.items():
            rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
            dst = Path(tmp) / f"{split}.jsonl"
            dst.write_text("".join(json.dumps(r) + "\n" for r in rows_for_split(split, rows)))
            data_files[split] = str(dst)
        _build_dataset(datasets_dir, repo_id, config_name, data_files, features, source_hash)


def _final_answer(gsm8k_answer: str) -> str:
    return gsm8k_answer.split("####")[-1].strip()


def prepare_hh_rlhf_standin(datasets_dir: Path, gsm8k_dir: Path) -> None:
    """Anthropic/hh-rlhf's schema (chosen/rejected transcripts sharing every turn but the last):
    the chosen reply is the GSM8K worked answer, the rejected one the answer to the next question.
    The test split keeps 16 pairs: the recipe evaluates on it at step 0 and at the last step, one
    compute_logprobs per sequence (the real test split would be 2,048 of them per evaluation)."""
    import datasets

    def rows(split, gsm8k):
        gsm8k = gsm8k[:16] if split == "test" else gsm8k
        out = []
        for i, row in enumerate(gsm8k):
            wrong = gsm8k[(i + 1) % len(gsm8k)]["answer"]
            prompt = f"\n\nHuman: {row['question']}\n\nAssistant:"
            out.append({"chosen": f"{prompt} {row['answer']}", "rejected": f"{prompt} {wrong}"})
        return out

    features = datasets.Features(
        {"chosen": datasets.Value("string"), "rejected": datasets.Value("string")}
    )
    _write_standin(
        datasets_dir, gsm8k_dir, "Anthropic/hh-rlhf", "default", features, rows, tag="test16"
    )


def prepare_deepmath_standin(datasets_dir: Path, gsm8k_dir: Path) -> None:
    """zwhe99/DeepMath-103K's columns that the cookbook reads (question, final_answer), from GSM8K."""
    import datasets

    def rows(split, gsm8k):
        return [
            {
                "question": r["question"],
                "final_answer": _final_answer(r["answer"]),
                "difficulty": 1.0,
                "topic": "Mathematics -> Applied Mathematics -> Math Word Problems",
            }
            for r in gsm8k
        ]

    features = datasets.Features(
        {
            "question": datasets.Value("string"),
            "final_answer": datasets.Value("string"),
            "difficulty": datasets.Value("float64"),
            "topic": datasets.Value("string"),
        }
    )
    _write_standin(datasets_dir, gsm8k_dir, "zwhe99/DeepMath-103K", "default", features, rows)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--hf-home", required=True, type=Path, help="the folder to use as HF_HOME")
    ap.add_argument("--model-dir", required=True, type=Path, help="SmolLM2 Hugging Face folder")
    ap.add_argument(
        "--repo-id", action="append", required=True, help="hub id to alias (repeatable)"
    )
    ap.add_argument(
        "--gsm8k-dir", required=True, type=Path, help="folder with train.jsonl, test.jsonl"
    )
    ap.add_argument(
        "--no-weights", action="store_true", help="tokenizer/config only in the hub cache"
    )
    args = ap.parse_args()

    hf_home = args.hf_home.resolve()
    hub_dir = hf_home / "hub"
    datasets_dir = hf_home / "datasets"
    hub_dir.mkdir(parents=True, exist_ok=True)
    datasets_dir.mkdir(parents=True, exist_ok=True)
    for repo_id in args.repo_id:
        prepare_hub_repo(hub_dir, repo_id, args.model_dir.resolve(), not args.no_weights)
    prepare_gsm8k(datasets_dir, args.gsm8k_dir.resolve())
    prepare_no_robots_standin(datasets_dir, args.gsm8k_dir.resolve())
    prepare_hh_rlhf_standin(datasets_dir, args.gsm8k_dir.resolve())
    prepare_deepmath_standin(datasets_dir, args.gsm8k_dir.resolve())


if __name__ == "__main__":
    main()
