"""Exact, resumable data order: which dataset items each batch holds, as a pure function of a small cursor.

Why: a resume that silently replays or skips data is the most common resume bug. Here the permutation of epoch
``e`` depends only on ``(seed, e)``, and the whole loader position is a :class:`DataCursor` (epoch, index into
that epoch's permutation, shuffle seed) that fits in a JSON checkpoint. Consuming N batches straight and
consuming k batches, serializing the cursor, rebuilding everything and consuming N − k gives the same batches.

The permutation comes from a SplitMix64 hash of ``(seed, epoch, position)`` computed with numpy uint64
arithmetic and a stable argsort, not from a library RNG stream: library RNG streams may change between
versions (numpy's ``Generator`` makes no stream guarantee), and a checkpoint must resume in the same order after
an upgrade. A batch never mixes epochs: the last short batch of an epoch is returned as is, or skipped with
``drop_last``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64 increment (golden ratio)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array (wrapping arithmetic): a fast, well-mixed, portable hash."""
    x = x.copy()
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _mix_int(value: int) -> int:
    return int(_splitmix64(np.array([value & _MASK64], dtype=np.uint64))[0])


def epoch_permutation(n_items: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled order of ``range(n_items)`` for ``epoch``: a pure function of ``(n_items, seed, epoch)``."""
    state = _mix_int(_mix_int(seed) ^ (epoch & _MASK64))
    with np.errstate(over="ignore"):
        positions = np.arange(1, n_items + 1, dtype=np.uint64) * np.uint64(_GAMMA) + np.uint64(state)
    keys = _splitmix64(positions)
    return np.argsort(keys, kind="stable").astype(np.int64)


@dataclass(frozen=True)
class DataCursor:
    """Where the loader stands: the next batch starts at ``index`` in ``epoch``'s permutation of ``shuffle_seed``."""

    epoch: int
    index: int
    shuffle_seed: int

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> DataCursor:
        try:
            return cls(epoch=int(state["epoch"]), index=int(state["index"]), shuffle_seed=int(state["shuffle_seed"]))
        except KeyError as exc:
            raise ValueError(f"data cursor state lacks {exc.args[0]!r}: {dict(state)!r}") from None


class DataOrder:
    """Batches of item indices over ``n_items`` items, epoch after epoch, resumable from a :class:`DataCursor`.

    Stateless apart from a one-epoch permutation cache: the position lives in the cursor the caller keeps (and
    checkpoints), so there is no hidden iterator state to forget to save.
    """

    def __init__(self, n_items: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = False):
        if n_items < 1:
            raise ValueError(f"n_items must be ≥ 1 (got {n_items})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1 (got {batch_size})")
        if drop_last and batch_size > n_items:
            raise ValueError(f"drop_last with batch_size {batch_size} > n_items {n_items} would yield no batch")
        self.n_items = int(n_items)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self._cache: tuple[int, np.ndarray] | None = None

    # -- description ---------------------------------------------------------------------------------------
    @property
    def items_per_epoch(self) -> int:
        """Items actually consumed per epoch (the dropped tail excluded)."""
        if self.drop_last:
            return (self.n_items // self.batch_size) * self.batch_size
        return self.n_items

    @property
    def batches_per_epoch(self) -> int:
        if self.drop_last:
            return self.n_items // self.batch_size
        return -(-self.n_items // self.batch_size)

    def start(self, epoch: int = 0) -> DataCursor:
        """The cursor of the first batch of ``epoch``."""
        return DataCursor(epoch=epoch, index=0, shuffle_seed=self.seed)

    def permutation(self, epoch: int) -> np.ndarray:
        """Item order of ``epoch`` (identity when not shuffling)."""
        if epoch < 0:
            raise ValueError(f"epoch must be ≥ 0 (got {epoch})")
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        if self.shuffle:
            perm = epoch_permutation(self.n_items, self.seed, epoch)
        else:
            perm = np.arange(self.n_items, dtype=np.int64)
        perm.setflags(write=False)
        self._cache = (epoch, perm)
        return perm

    # -- iteration -----------------------------------------------------------------------------------------
    def normalize(self, cursor: DataCursor) -> DataCursor:
        """Check ``cursor`` belongs to this order and move an end-of-epoch position to the next epoch's start."""
        if cursor.shuffle_seed != self.seed:
            raise ValueError(
                f"data cursor was made with shuffle seed {cursor.shuffle_seed}, this order uses {self.seed}"
            )
        if cursor.epoch < 0 or not 0 <= cursor.index <= self.n_items:
            raise ValueError(f"data cursor {cursor} is out of range for {self.n_items} items")
        if cursor.index >= self.items_per_epoch:
            return DataCursor(epoch=cursor.epoch + 1, index=0, shuffle_seed=self.seed)
        return cursor

    def next_batch(self, cursor: DataCursor) -> tuple[list[int], DataCursor]:
        """The batch at ``cursor`` and the cursor after it (at an epoch's end: the next epoch's start)."""
        cursor = self.normalize(cursor)
        perm = self.permutation(cursor.epoch)
        end = min(cursor.index + self.batch_size, self.n_items)
        batch = perm[cursor.index:end].tolist()
        after = DataCursor(epoch=cursor.epoch, index=end, shuffle_seed=self.seed)
        return batch, self.normalize(after)

    def take(self, cursor: DataCursor, n_batches: int) -> tuple[list[list[int]], DataCursor]:
        """``n_batches`` consecutive batches from ``cursor`` and the cursor after them."""
        out: list[list[int]] = []
        for _ in range(n_batches):
            batch, cursor = self.next_batch(cursor)
            out.append(batch)
        return out, cursor

    def items_seen(self, cursor: DataCursor) -> int:
        """Items consumed from the very start up to ``cursor`` (for logging and replay/skip checks)."""
        cursor = self.normalize(cursor)
        return cursor.epoch * self.items_per_epoch + cursor.index

    # -- persistence ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What defines the order (the position is the cursor's business)."""
        return {"n_items": self.n_items, "batch_size": self.batch_size, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last}

    def check_resumable(self, saved: Mapping[str, Any]) -> None:
        """Raise ValueError naming the fields where ``saved`` (a checkpointed :meth:`state_dict`) differs: a
        cursor only means the same batches over the same dataset size, batch size, seed and flags."""
        mine = self.state_dict()
        diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {v!r}" for k, v in mine.items() if saved.get(k) != v]
        if diffs:
            raise ValueError("data order differs from the checkpoint's, resuming would replay or skip items: "
                             + "; ".join(diffs))

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> DataOrder:
        return cls(n_items=int(state["n_items"]), batch_size=int(state["batch_size"]), seed=int(state["seed"]),
                   shuffle=bool(state.get("shuffle", True)), drop_last=bool(state.get("drop_last", False)))

    def __repr__(self) -> str:
        return (f"DataOrder(n_items={self.n_items}, batch_size={self.batch_size}, seed={self.seed}, "
                f"shuffle={self.shuffle}, drop_last={self.drop_last})")
