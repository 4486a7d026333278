"""Resumable data order: pure per-epoch permutations, epoch-respecting batches, exact resume from any cursor."""

from __future__ import annotations

import json

import numpy as np
import pytest

from infra.training.data_order import DataCursor, DataOrder, epoch_permutation

SHAPES = [  # n_items, batch_size, shuffle, drop_last
    (10, 3, True, False),
    (10, 3, True, True),
    (12, 4, True, False),  # batches tile the epoch exactly
    (12, 4, False, True),
    (5, 7, True, False),  # one short batch per epoch
    (7, 1, True, False),
    (9, 2, False, False),
]


def _straight(order: DataOrder, n: int) -> list[list[int]]:
    batches, _ = order.take(order.start(), n)
    return batches


def test_permutation_is_a_pure_function_of_seed_and_epoch() -> None:
    for epoch in range(5):
        perm = epoch_permutation(50, seed=3, epoch=epoch)
        assert sorted(perm.tolist()) == list(range(50))
        assert np.array_equal(perm, DataOrder(50, 4, seed=3).permutation(epoch))
    assert not np.array_equal(epoch_permutation(50, 3, 0), epoch_permutation(50, 3, 1))
    assert not np.array_equal(epoch_permutation(50, 3, 0), epoch_permutation(50, 4, 0))
    # Pinned values: the order must not change with numpy (or this code) between a crash and its resume.
    assert epoch_permutation(8, 0, 0).tolist() == [2, 4, 6, 5, 1, 7, 0, 3]
    assert epoch_permutation(8, 0, 1).tolist() == [7, 4, 1, 2, 6, 5, 0, 3]
    assert epoch_permutation(10, 12345, 7).tolist() == epoch_permutation(10, 12345, 7).tolist()


@pytest.mark.parametrize(("n_items", "batch_size", "shuffle", "drop_last"), SHAPES)
def test_batches_never_mix_epochs_and_cover_each_epoch_once(n_items: int, batch_size: int, shuffle: bool,
                                                            drop_last: bool) -> None:
    order = DataOrder(n_items, batch_size, seed=11, shuffle=shuffle, drop_last=drop_last)
    cursor = order.start()
    for epoch in range(3):
        seen: list[int] = []
        for i in range(order.batches_per_epoch):
            assert cursor.epoch == epoch
            batch, cursor = order.next_batch(cursor)
            last = i == order.batches_per_epoch - 1
            assert len(batch) == batch_size or (last and not drop_last and len(batch) == n_items % batch_size)
            seen += batch
        assert cursor == DataCursor(epoch + 1, 0, 11)  # an epoch boundary is always the next epoch's start
        assert seen == order.permutation(epoch)[: order.items_per_epoch].tolist()
        assert len(set(seen)) == len(seen) == order.items_per_epoch
        assert order.items_seen(cursor) == (epoch + 1) * order.items_per_epoch


@pytest.mark.parametrize(("n_items", "batch_size", "shuffle", "drop_last"), SHAPES)
def test_resume_from_any_cursor_equals_straight(n_items: int, batch_size: int, shuffle: bool,
                                                drop_last: bool) -> None:
    order = DataOrder(n_items, batch_size, seed=5, shuffle=shuffle, drop_last=drop_last)
    total = 3 * order.batches_per_epoch + 1
    straight = _straight(order, total)
    boundaries = 0
    for k in range(total + 1):
        first, cursor = order.take(order.start(), k)
        # What a checkpoint stores, through JSON; a new process rebuilds both objects from it.
        blob = json.dumps({"order": order.state_dict(), "cursor": cursor.state_dict()})
        saved = json.loads(blob)
        resumed_order = DataOrder.from_state(saved["order"])
        rest, _ = resumed_order.take(DataCursor.from_state(saved["cursor"]), total - k)
        assert first + rest == straight, f"k={k}"
        boundaries += cursor.index == 0
    assert boundaries >= 3  # resumed exactly at epoch boundaries too


def test_end_of_epoch_cursor_is_normalized() -> None:
    order = DataOrder(6, 4, seed=0)
    at_end = DataCursor(epoch=2, index=6, shuffle_seed=0)
    batch, after = order.next_batch(at_end)
    assert batch == order.permutation(3)[:4].tolist()
    assert after == DataCursor(3, 4, 0)
    dropping = DataOrder(6, 4, seed=0, drop_last=True)
    assert dropping.normalize(DataCursor(0, 4, 0)) == DataCursor(1, 0, 0)
    assert dropping.batches_per_epoch == 1 and dropping.items_per_epoch == 4


def test_bad_arguments_and_foreign_cursors_are_refused() -> None:
    order = DataOrder(10, 3, seed=1)
    with pytest.raises(ValueError, match="shuffle seed 2"):
        order.next_batch(DataCursor(0, 0, 2))
    with pytest.raises(ValueError, match="out of range"):
        order.next_batch(DataCursor(0, 11, 1))
    with pytest.raises(ValueError):
        DataOrder(0, 3, seed=1)
    with pytest.raises(ValueError, match="drop_last"):
        DataOrder(3, 4, seed=1, drop_last=True)
    order.check_resumable(DataOrder(10, 3, seed=1).state_dict())
    with pytest.raises(ValueError, match="n_items: checkpoint 11 vs now 10"):
        order.check_resumable(DataOrder(11, 3, seed=1).state_dict())
    with pytest.raises(ValueError, match="lacks 'index'"):
        DataCursor.from_state({"epoch": 0, "shuffle_seed": 1})


def test_large_epoch_permutation_is_fast() -> None:
    order = DataOrder(1_000_000, 256, seed=9)
    batch, cursor = order.next_batch(order.start())
    assert len(batch) == 256 and cursor.index == 256
    again, _ = order.next_batch(cursor)  # cached permutation: no recomputation per batch
    assert not set(batch) & set(again)
