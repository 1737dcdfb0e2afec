from __future__ import annotations

import json

import pytest

from skyrl_trainer.data import Problem, PromptStream


def _problems(n: int) -> list[Problem]:
    return [Problem([{"role": "user", "content": str(i)}], {"answer": str(i)}) for i in range(n)]


def _ids(batch: list[Problem]) -> list[int]:
    return [int(p.sample["answer"]) for p in batch]


def test_each_epoch_covers_every_problem_once_in_a_new_order():
    stream = PromptStream(_problems(12), batch_size=4, seed=7)
    assert stream.num_batches_per_epoch == 3
    epochs = []
    for _ in range(3):
        epochs.append([i for _ in range(3) for i in _ids(stream.next_batch())])
    assert all(sorted(order) == list(range(12)) for order in epochs)
    assert len({tuple(order) for order in epochs}) == 3
    assert epochs[0] != list(range(12))
    assert (stream.epoch, stream.position) == (3, 0)


def test_order_depends_on_the_seed_only():
    first = PromptStream(_problems(20), 5, seed=1)
    again = PromptStream(_problems(20), 5, seed=1)
    other = PromptStream(_problems(20), 5, seed=2)
    a = [_ids(first.next_batch()) for _ in range(8)]
    assert a == [_ids(again.next_batch()) for _ in range(8)]
    assert a != [_ids(other.next_batch()) for _ in range(8)]


def test_batches_straddle_epochs():
    stream = PromptStream(_problems(10), batch_size=4, seed=0)
    assert stream.num_batches_per_epoch == 3
    batches = [_ids(stream.next_batch()) for _ in range(5)]  # 20 problems = exactly 2 epochs
    assert all(len(b) == 4 for b in batches)
    flat = [i for b in batches for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert (stream.epoch, stream.position) == (2, 0)
    stream.next_batch()
    assert (stream.epoch, stream.position) == (2, 4)


def test_batch_larger_than_the_dataset():
    stream = PromptStream(_problems(3), batch_size=7, seed=0, shuffle=False)
    assert _ids(stream.next_batch()) == [0, 1, 2, 0, 1, 2, 0]
    assert (stream.epoch, stream.position) == (2, 1)


def test_exact_resume():
    uninterrupted = PromptStream(_problems(13), batch_size=3, seed=5)
    expected = [_ids(uninterrupted.next_batch()) for _ in range(12)]

    stream = PromptStream(_problems(13), batch_size=3, seed=5)
    for _ in range(7):
        stream.next_batch()
    state = json.loads(json.dumps(stream.state_dict()))
    assert state["seed"] == 5 and (state["epoch"], state["position"]) == (1, 8)

    restored = PromptStream(_problems(13), batch_size=3, seed=999)
    restored.load_state_dict(state)
    assert (restored.epoch, restored.position) == (1, 8)
    assert [_ids(restored.next_batch()) for _ in range(5)] == expected[7:]


def test_no_shuffle_keeps_order():
    stream = PromptStream(_problems(5), batch_size=2, seed=3, shuffle=False)
    assert [_ids(stream.next_batch()) for _ in range(5)] == [[0, 1], [2, 3], [4, 0], [1, 2], [3, 4]]


def test_errors():
    with pytest.raises(ValueError, match="batch_size"):
        PromptStream(_problems(3), batch_size=0, seed=0)
    with pytest.raises(ValueError, match="at least one problem"):
        PromptStream([], batch_size=2, seed=0)
    with pytest.raises(ValueError, match="seed"):
        PromptStream(_problems(3), batch_size=2, seed=-1)
    stream = PromptStream(_problems(3), batch_size=2, seed=0)
    with pytest.raises(ValueError, match="saved over 4 problems"):
        stream.load_state_dict({"seed": 0, "epoch": 0, "position": 0, "num_problems": 4})
    with pytest.raises(ValueError, match="out of range"):
        stream.load_state_dict({"seed": 0, "epoch": 0, "position": 3})
    with pytest.raises(ValueError, match="lacks"):
        stream.load_state_dict({"seed": 0})
