"""The one row type every dataset loader produces, and the report of rows that could not be used.

Training, evaluation and the synthetic task all hand questions around as :class:`QuestionRow`, so a flow never
cares whether a question came from a verl Parquet, a JSONL benchmark or the generator.  Validation problems are
collected as :class:`BadRow` records (row index + field) instead of failing on the first one, so a user sees every
defect of a file at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# How many bad rows an error message lists before it says "and N more" (the full list stays on the exception).
MAX_LISTED_BAD_ROWS = 20


@dataclass(frozen=True)
class QuestionRow:
    """One question with its gold answers.

    ``family`` is the question type used for per-family tables (synthetic: ``single_hop`` / ``two_hop`` /
    ``compute``; verl: the row's ``ability``); ``metadata`` keeps source-specific extras (original index, prompt
    messages, the synthetic relation and entities).  ``metadata`` is excluded from hashing so rows can be set
    members even though a dict is not hashable.
    """

    id: str
    question: str
    golds: tuple[str, ...]
    data_source: str
    family: str = ""
    split: str = ""
    metadata: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class BadRow:
    """A row that failed validation: its 0-based position in the source, the offending field and why.

    ``line`` is set for line-based files (JSONL): the 1-based line as an editor shows it, blank lines counted, which
    is what a user looks for; ``index`` stays the record's position (question ids are built from it).
    """

    index: int
    field: str
    reason: str
    line: int | None = None

    @property
    def where(self) -> str:
        return f"line {self.line}" if self.line is not None else f"row {self.index}"

    def __str__(self) -> str:
        return f"{self.where}: {self.field}: {self.reason}"


class BadRowError(ValueError):
    """Raised when a dataset has invalid rows and the policy is ``fail``; ``bad_rows`` lists all of them."""

    def __init__(self, source: str, bad_rows: Sequence[BadRow]) -> None:
        self.source = source
        self.bad_rows = list(bad_rows)
        listed = "; ".join(str(b) for b in self.bad_rows[:MAX_LISTED_BAD_ROWS])
        more = len(self.bad_rows) - MAX_LISTED_BAD_ROWS
        suffix = f"; and {more} more" if more > 0 else ""
        super().__init__(
            f"{source}: {len(self.bad_rows)} invalid row(s): {listed}{suffix} "
            "(set on_bad_row='skip' to drop them)"
        )
