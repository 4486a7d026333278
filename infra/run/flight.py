"""A sweep's children in flight on a deployment: what the fan-out watches and when it gives up on one.

Each child is a flow run of the deployment (submitted by the sweep flow). :meth:`Flight.poll` reads each one's
state once and lands those that are done with: ended (completed or not), lost (Running, but no heartbeat for
``lost_after_s``: its worker is gone; marked Crashed) or timed out (still unfinished ``timeout_s`` after its
submission; cancelled). The Prefect calls are :mod:`infra.prefect_api`'s; the sweep flow logs and reports the
landings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient

from aepo_core.config_keys import ConfigError
from infra.prefect_api import ChildRun, check_deployment, lost_after


class Outcome(Enum):
    COMPLETED = "completed"
    ENDED = "ended"  # in a final state other than Completed
    LOST = "lost"
    TIMED_OUT = "timed out"


@dataclass(frozen=True)
class Landing:
    """A child the flight is done with."""

    name: str
    flow_run_id: UUID
    outcome: Outcome
    state: str
    """Its Prefect state's name when it landed ("no state": none yet)."""
    message: str | None = None
    seconds: float = 0.0
    """Lost: the silence that made it lost; timed out: the timeout."""

    @property
    def failure(self) -> str | None:
        """What the sweep reports for a child that did not complete (None: it completed)."""
        if self.outcome is Outcome.COMPLETED:
            return None
        if self.outcome is Outcome.LOST:
            return f"lost: no heartbeat for over {self.seconds:g} s"
        if self.outcome is Outcome.TIMED_OUT:
            return f"timed out after {self.seconds:g} s in {self.state}"
        return self.state


def check_fan_out(deployment: str | None, max_parallel: int, child_timeout_s: float | None,
                  child_lost_after_s: float | None) -> None:
    """The fan-out's limits must make sense and the deployment (if any) must exist on the Prefect API this process
    talks to: a bad one or a typo fails before anything starts (``ConfigError``)."""
    if max_parallel < 1:
        raise ConfigError(f"sweep max_parallel must be >= 1; got {max_parallel}")
    if child_timeout_s is not None and child_timeout_s <= 0:
        raise ConfigError(f"sweep child_timeout_s must be > 0 (or None); got {child_timeout_s}")
    if child_lost_after_s is not None and child_lost_after_s <= 0:
        raise ConfigError(f"sweep child_lost_after_s must be > 0 (or None); got {child_lost_after_s}")
    if deployment is not None:
        check_deployment(deployment)


@dataclass
class Flight:
    """The children in flight. ``timeout_s``: after its submission (None: never); ``lost_after_s``: after its last
    heartbeat (None: 3 × this process's ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``; never with heartbeats off)."""

    client: SyncPrefectClient
    timeout_s: float | None
    lost_after_s: float | None
    children: dict[UUID, ChildRun] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.lost_after_s = lost_after(self.lost_after_s)

    def __len__(self) -> int:
        return len(self.children)

    def add(self, flow_run_id: UUID, name: str) -> None:
        self.children[flow_run_id] = ChildRun(name, time.monotonic())

    def poll(self) -> list[Landing]:
        """Read each child's state once; returns (and forgets) those that landed: ended, lost (marked Crashed) or
        timed out (cancelled)."""
        landed = [landing for flow_run_id, child in list(self.children.items())
                  if (landing := self._check(flow_run_id, child)) is not None]
        for landing in landed:
            del self.children[landing.flow_run_id]
        return landed

    def _check(self, flow_run_id: UUID, child: ChildRun) -> Landing | None:
        from prefect.states import Cancelling, Crashed

        now = time.monotonic()
        state = self.client.read_flow_run(flow_run_id).state
        if state is not None and state.is_final():
            outcome = Outcome.COMPLETED if state.is_completed() else Outcome.ENDED
            return Landing(child.name, flow_run_id, outcome, state.name or state.type.value, state.message)
        silent = (child.silent_for(self.client, flow_run_id, self.lost_after_s, now)
                  if self.lost_after_s is not None and state is not None and state.is_running() else None)
        if silent is not None:
            self.client.set_flow_run_state(flow_run_id, Crashed(
                message=f"aepo sweep: no heartbeat for over {silent:g} s (worker lost)"), force=True)
            return Landing(child.name, flow_run_id, Outcome.LOST, "Crashed", seconds=silent)
        if self.timeout_s is not None and now - child.submitted > self.timeout_s:
            self.client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
            return Landing(child.name, flow_run_id, Outcome.TIMED_OUT,
                           state.name if state is not None else "no state", seconds=self.timeout_s)
        return None

    def cancel_all(self) -> list[tuple[str, UUID]]:
        """Cancel every child still in flight (the sweep itself was stopped); returns them (name, flow run)."""
        from prefect.states import Cancelling

        for flow_run_id in self.children:
            self.client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
        return [(child.name, flow_run_id) for flow_run_id, child in self.children.items()]
