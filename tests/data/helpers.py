"""Small rows and writers shared by the data tests."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


SMALL_ROWS = [
    {"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"},
    {"question": "How many legs do 3 cats have?", "answer": "3 * 4 = 12\n#### 12"},
    {"question": "What is 1000 + 80?", "answer": "#### 1,080"},
]
