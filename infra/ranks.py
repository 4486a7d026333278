"""The data-parallel ranks of a training run (``torchrun``/``deepspeed`` launchers) as the update and flow see them.

A run under a launcher is SPMD: every rank runs the same training loop on the same global data, and the few places
where ranks differ ask a :class:`Ranks`:

- rollouts: each rank rolls out :meth:`Ranks.shard` of the step's questions, then :meth:`Ranks.all_gather`
  gives every rank the whole step (trees are small: token ids and log-probs), so scoring, dynamic sampling and
  the data cursor are the same on every rank;
- the update: every rank holds the global samples and trains on its share of each mini-batch's question groups
  (:meth:`Ranks.shard`), with normalisers taken over the global mini-batch;
- side effects (MLflow, Parquet trajectories, checkpoint files, the Prefect flow run): rank 0 only
  (:attr:`Ranks.is_main`).

One process without a launcher is ``Ranks(0, 1)``: every method is then the identity and starts nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's data-parallel ``rank`` among ``world_size`` (collectives over the default process group)."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def current(cls) -> Ranks:
        """The default process group's rank and size when one is initialised, else the launcher's ``RANK`` /
        ``WORLD_SIZE`` (before the group exists), else one process."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return cls(torch.distributed.get_rank(), torch.distributed.get_world_size())
        return cls(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, stores and writes checkpoint files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def shard(self, items: Sequence[T], rank: int | None = None) -> list[T]:
        """``rank``'s (default: this rank's) contiguous share of ``items``: the first ``len % world_size`` ranks
        get one more. Contiguous, so gathering the shards in rank order gives ``items`` back."""
        r = self.rank if rank is None else rank
        base, extra = divmod(len(items), self.world_size)
        start = r * base + min(r, extra)
        return list(items[start : start + base + (1 if r < extra else 0)])

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` for one process."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def gather_to_main(self, obj: T) -> list[T] | None:
        """Every rank's ``obj`` in rank order on rank 0, None elsewhere (a collective: every rank calls it)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        torch.distributed.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box: list[Any] = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def sum(self, value: float) -> float:
        """``value`` summed over the ranks."""
        return float(sum(self.all_gather(value))) if self.distributed else value

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def finish(self) -> None:
        """The end of a run that succeeded on every rank: wait for all of them, then tear the process group down.

        A rank that exits while the gloo group is alive (its peers still writing checkpoints or weights) can
        abort in C++ ("terminate called without an active exception", SIGABRT: seen in 1 of ~10 two-rank ZeRO-3
        runs under load), and the launcher then kills the others and reports the run failed."""
        if self.distributed and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
