from __future__ import annotations

import datasets
import pytest

from skyrl_trainer.data import load_rows
from tests.data.helpers import SMALL_ROWS, write_jsonl


def _write_parquet(path, rows):
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_jsonl_file(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", SMALL_ROWS)
    assert load_rows(str(path), "train") == SMALL_ROWS


def test_json_array_file(tmp_path):
    import json

    path = tmp_path / "rows.json"
    path.write_text(json.dumps(SMALL_ROWS))
    assert load_rows(str(path), "test") == SMALL_ROWS


def test_parquet_file(tmp_path):
    path = _write_parquet(tmp_path / "rows.parquet", SMALL_ROWS)
    assert load_rows(str(path), "train", required=("question", "answer")) == SMALL_ROWS


def test_folder_picks_the_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", SMALL_ROWS)
    write_jsonl(tmp_path / "test.jsonl", SMALL_ROWS[:1])
    assert load_rows(str(tmp_path), "train") == SMALL_ROWS
    assert load_rows(str(tmp_path), "test") == SMALL_ROWS[:1]


def test_folder_with_parquet_split_and_shards(tmp_path):
    _write_parquet(tmp_path / "test.parquet", SMALL_ROWS[:1])
    _write_parquet(tmp_path / "train-00000-of-00002.parquet", SMALL_ROWS[:2])
    _write_parquet(tmp_path / "train-00001-of-00002.parquet", SMALL_ROWS[2:])
    assert load_rows(str(tmp_path), "test") == SMALL_ROWS[:1]
    assert load_rows(str(tmp_path), "train") == SMALL_ROWS


def test_real_gsm8k_test_split(gsm8k_dir):
    rows = load_rows(str(gsm8k_dir), "test", required=("question", "answer"))
    assert len(rows) == 1319
    assert rows[0]["answer"].endswith("#### 18")


def test_hub_id_with_config(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(SMALL_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_rows("openai/gsm8k:main", "test") == SMALL_ROWS
    assert load_rows("openai/gsm8k", "train") == SMALL_ROWS
    assert calls == [("openai/gsm8k", "main", "test"), ("openai/gsm8k", None, "train")]


@pytest.mark.parametrize("field", ["data.path", "data.eval_path"])
def test_missing_file_names_the_field(tmp_path, field):
    with pytest.raises(ValueError, match=rf"^{field}: no such file or folder") as info:
        load_rows(str(tmp_path / "nope.jsonl"), "train", field=field)
    assert "nope.jsonl" in str(info.value)


@pytest.mark.parametrize("path", ["./data/gsm8k", "~/no/such/folder", "a/b/c"])
def test_missing_folder_path(path):
    with pytest.raises(ValueError, match=r"^data.path: no such file or folder"):
        load_rows(path, "train")


def test_empty_json_array(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text("[]\n")
    with pytest.raises(ValueError, match=r"^data.path: .* has no rows"):
        load_rows(str(path), "train")


def test_folder_without_the_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", SMALL_ROWS)
    with pytest.raises(ValueError, match=r"^data.eval_path: folder .* has no 'test' split") as info:
        load_rows(str(tmp_path), "test", field="data.eval_path")
    assert "splits found: ['train']" in str(info.value)


def test_hub_id_offline_says_what_to_do():
    with pytest.raises(ValueError, match=r"^data.path: .*hub dataset") as info:
        load_rows("skyrl-tests-no-such-owner/no-such-dataset:main", "train")
    assert "no network: download it once or give a local path" in str(info.value)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match=r"^data.path: .* has no rows"):
        load_rows(str(path), "train")


def test_parquet_without_rows(tmp_path):
    path = tmp_path / "empty.parquet"
    datasets.Dataset.from_dict({"question": [], "answer": []}).to_parquet(str(path))
    with pytest.raises(ValueError, match=r"^data.eval_path: .* has no rows"):
        load_rows(str(path), "test", field="data.eval_path")


def test_missing_required_column(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"problem": "1+1", "answer": "2"}])
    with pytest.raises(
        ValueError, match=r"^data.path: .* has no column\(s\) \['question'\]"
    ) as info:
        load_rows(str(path), "train", required=("question", "answer"))
    assert "question_key" in str(info.value)


def test_unreadable_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("this is not json\n")
    with pytest.raises(ValueError, match=r"^data.path: could not read .* as json"):
        load_rows(str(path), "train")


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"^data.path: could not read .* as parquet"):
        load_rows(str(path), "train")


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("question,answer\n1+1,2\n")
    with pytest.raises(ValueError, match=r"^data.path: .* is not a .jsonl, .json or .parquet file"):
        load_rows(str(path), "train")
