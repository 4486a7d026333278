"""How an engine takes new policy weights: the protocol every engine behind a training run implements.

After cold-start SFT, every optimizer step and a resume, the trainer's weights change; the engine that samples the
next rollouts must sample from them.  Each engine knows how: the in-process engine refreshes its own low-precision
copy (or does nothing when it shares the training model), a remote engine saves an HF checkpoint and asks its
server to reload it.  Nobody probes an engine for hooks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from aepo_core.interfaces import Engine


def _no_gathered_weights() -> None:
    return None


@dataclass(frozen=True)
class PolicyWeights:
    """The trainer's current weights, as an engine takes them.

    ``model`` is the live training model; ``version`` the number of optimizer steps behind it (0: before RL);
    ``full_state_dict`` returns the gathered full weights when the live parameters are only partitions (ZeRO-3),
    else None (the model holds them).  It is called only by an engine that needs a full copy (a remote one), so
    the in-process engine never pays for a gather.
    """

    model: torch.nn.Module
    version: int
    full_state_dict: Callable[[], Mapping[str, torch.Tensor] | None] = _no_gathered_weights


WeightSource = PolicyWeights | str | os.PathLike[str]
"""Live weights, or the directory of an HF checkpoint (``save_pretrained`` layout) to load."""


class PolicyEngine(Engine, Protocol):
    """An :class:`~aepo_core.interfaces.Engine` that follows the policy's weights."""

    def load_weights(self, source: WeightSource) -> None:
        """Sample from ``source`` from the next ``generate`` on."""
        ...

    def release(self) -> None:
        """A rollout is over: drop what was kept between its generate calls (the in-process engine's retained KV
        caches); the next rollout starts from other prompts or other weights."""
        ...

    def close(self) -> None:
        """The run is over: free what the engine holds and remove what it wrote (a remote engine's weight exports,
        which the checkpoints make redundant); idempotent."""
        ...

    @property
    def weight_version(self) -> str | None:
        """The label of the weights last loaded, which every result stamped with a version must carry; None when
        the engine stamps none (the in-process engine samples from the trainer's weights themselves)."""
        ...
