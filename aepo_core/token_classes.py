"""Where a policy's entropy lives (issue 53 §1): every model token of a response in one class, and the entropy of
each class, so a run shows how much AEPO's mechanisms had to act on.

Classes, from the protocol's tags (:mod:`aepo_core.protocol`):

- ``template``: the tags themselves and whatever lies between blocks (``<think>``, ``</search>``, newlines);
- ``thought``: inside ``<think>…</think>``;
- ``query``: a tool call's argument, inside ``<search>…</search>`` or ``<python>…</python>``;
- ``answer``: inside ``<answer>…</answer>``;
- ``result``: a tool's result (not the model's: masked out of the update, and out of this tally).

Two windows, which overlap the classes: the **root window**, the first W model tokens of the response (where H_root
is measured), and the **post-tool windows**, the first W model tokens after each tool result (what ΔH reads). And
the share of model tokens at or above :data:`HIGH_ENTROPY_NATS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aepo_core.protocol import TAG_RE
from aepo_core.rollout.tree import RolloutTree

TOKEN_CLASSES: tuple[str, ...] = ("template", "thought", "query", "answer")
"""The classes of model tokens, in the order they are reported."""
WINDOWS: tuple[str, ...] = ("root_window", "post_tool_window")
HIGH_ENTROPY_NATS = 0.672
"""The 80th percentile of token entropy in Qwen3-8B's chain-of-thought ("Beyond the 80/20 rule", Wang et al. 2025),
the threshold issue 53 names: the share of model tokens at or above it says how much a high-entropy mechanism (the
``aepo`` clip gate, the branch rule) could find in a policy, on an absolute scale (the gate's own threshold is a
quantile of each mini-batch, so it always finds its 20 %)."""
_BLOCK_CLASS = {"think": "thought", "search": "query", "python": "query", "answer": "answer", "result": "result"}


def char_classes(text: str) -> list[str]:
    """The class of every character of ``text`` (a response): tag characters and text between blocks are
    ``template``; inside a block its class (an unclosed block runs to the end)."""
    out = ["template"] * len(text)
    inside: str | None = None
    start = 0
    for match in TAG_RE.finditer(text):
        closing, name = match.group(1) == "/", match.group(2)
        if inside is not None and closing and name == inside:
            out[start:match.start()] = [_BLOCK_CLASS[inside]] * (match.start() - start)
            inside = None
        elif inside is None and not closing:
            inside, start = name, match.end()
    if inside is not None:
        out[start:] = [_BLOCK_CLASS[inside]] * (len(text) - start)
    return out


def token_classes(pieces: Sequence[str], text: str) -> list[str]:
    """The class of each token, given each token's decoded text (``pieces``, in order) and the response's text: the
    class of the token's first non-space character (of its first character when all are spaces). Pieces that do not
    concatenate to ``text`` (a byte-level token split inside a multi-byte character) are aligned by position,
    clamped to the text."""
    chars = char_classes(text)
    out = []
    pos = 0
    for piece in pieces:
        span = chars[min(pos, len(chars) - 1):min(pos + max(len(piece), 1), len(chars))] if chars else []
        stripped = len(piece) - len(piece.lstrip())
        pick = min(stripped, len(span) - 1) if span else 0
        out.append(span[pick] if span else "template")
        pos += len(piece)
    return out


@dataclass
class EntropyTally:
    """Sums of model-token entropies (nats) and counts, per class and window, and the tokens at or above
    :data:`HIGH_ENTROPY_NATS`; added over responses (:meth:`add`)."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    high: int = 0
    tokens: int = 0

    def _put(self, name: str, value: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value
        self.counts[name] = self.counts.get(name, 0) + 1

    def add(self, classes: Sequence[str], entropies: Sequence[float], loss_mask: Sequence[int], window: int) -> None:
        """One response: its tokens' classes, entropies and loss mask (1 on model tokens); ``window`` is W. A run of
        model tokens after a tool result (mask 0 → 1) opens a post-tool window; the first run, the root window."""
        seen_model = False
        left = 0  # tokens left in the current window
        current = ""
        previous = 0
        for cls, h, m in zip(classes, entropies, loss_mask, strict=True):
            if not m:
                previous = 0
                continue
            if math.isnan(h):
                previous = 1
                continue
            if not previous:  # a model segment starts: the response's first, or one after a tool result
                current, left = ("post_tool_window" if seen_model else "root_window"), window
                seen_model = True
            previous = 1
            if left > 0:
                self._put(current, h)
                left -= 1
            self._put(cls, h)
            self.tokens += 1
            self.high += h >= HIGH_ENTROPY_NATS

    def merge(self, other: EntropyTally) -> None:
        for name, value in other.sums.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
            self.counts[name] = self.counts.get(name, 0) + other.counts[name]
        self.high += other.high
        self.tokens += other.tokens

    def mean(self, name: str) -> float:
        """Mean entropy of a class or window (NaN when it has no token)."""
        n = self.counts.get(name, 0)
        return self.sums[name] / n if n else math.nan

    def metrics(self) -> dict[str, float]:
        """``entropy_<class>`` (mean nats), ``share_<class>`` (of model tokens), ``entropy_<window>``, and
        ``high_entropy_share`` (at or above :data:`HIGH_ENTROPY_NATS`); ``entropy_model`` over all model tokens."""
        out = {f"entropy_{name}": self.mean(name) for name in (*TOKEN_CLASSES, *WINDOWS)}
        out.update({f"share_{name}": self.counts.get(name, 0) / self.tokens if self.tokens else math.nan
                    for name in TOKEN_CLASSES})
        total = sum(self.sums.get(name, 0.0) for name in TOKEN_CLASSES)
        out["entropy_model"] = total / self.tokens if self.tokens else math.nan
        out["high_entropy_share"] = self.high / self.tokens if self.tokens else math.nan
        return out


def tally_trees(trees: Sequence[RolloutTree], decode: Callable[[int], str], window: int) -> EntropyTally:
    """Every leaf of ``trees`` tallied as the update sees it (a shared prefix once per leaf): ``decode`` turns one
    token id into its text (the tokenizer's), ``window`` is W (``rollout.entropy_window``)."""
    tally = EntropyTally()
    for tree in trees:
        for leaf in tree.leaves:
            ids = tree.response_ids(leaf)
            tally.add(token_classes([decode(t) for t in ids], tree.text(leaf)), tree.entropies(leaf),
                      tree.loss_mask(leaf), window)
    return tally
