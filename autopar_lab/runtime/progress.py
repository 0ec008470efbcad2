"""A progress channel for a training job: events out, a cancel flag in.

The driver of a job publishes one :class:`ProgressEvent` per training step (and a last one when it ends); a notebook
widget or the CLI subscribes with a callback. The same channel carries the other direction: ``cancel()`` sets a flag
the driver checks between steps, so a job stops cleanly at a step boundary. No Ray, no Jupyter import here.

    >>> ch = ProgressChannel()
    >>> seen = []
    >>> unsubscribe = ch.subscribe(seen.append)
    >>> ch.publish(ProgressEvent(kind="step", step=1, loss=2.5, samples_per_s=100.0, stage_times=(0.1, 0.2)))
    >>> seen[0].loss, ch.losses
    (2.5, [2.5])
    >>> ch.cancel(); ch.cancelled
    True
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable

__all__ = ["ProgressEvent", "ProgressChannel", "EVENT_PREFIX", "format_event", "parse_event"]

# Jobs submitted to a remote cluster report progress as lines on stdout; this prefix tells them from other output.
EVENT_PREFIX = "AUTOPAR_EVENT "

KINDS = ("step", "restart", "note", "done", "cancelled", "error")


@dataclass(frozen=True)
class ProgressEvent:
    """One thing that happened in a job.

    kind: "step" (a step finished), "restart" (a stage actor died; the job went back to ``step``, its last
    checkpoint), "note" (something the user should know, e.g. a damaged checkpoint skipped on resume), "done",
    "cancelled" or "error" (``message`` says what). ``step`` counts finished steps (1-based for
    "step" events). ``stage_times``: seconds each stage computed during the step (forward + backward + update),
    measured inside the stage actor.
    """

    kind: str
    step: int = 0
    loss: float | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None
    stage_times: tuple[float, ...] = ()
    elapsed_s: float = 0.0
    message: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"progress event kind must be one of {KINDS}, got {self.kind!r}.")
        object.__setattr__(self, "stage_times", tuple(float(t) for t in self.stage_times))

    def to_dict(self) -> dict:
        out = asdict(self)
        out["stage_times"] = list(self.stage_times)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ProgressEvent":
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in names})


def format_event(event: ProgressEvent) -> str:
    """One line of text carrying ``event`` (what a job on a remote cluster prints)."""
    return EVENT_PREFIX + json.dumps(event.to_dict())


def parse_event(line: str) -> ProgressEvent | None:
    """The event on a line printed by :func:`format_event`, or None for any other line."""
    line = line.strip()
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        return ProgressEvent.from_dict(json.loads(line[len(EVENT_PREFIX):]))
    except (ValueError, TypeError):
        return None


@dataclass
class ProgressChannel:
    """Thread-safe fan-out of progress events to subscribers, plus a cancel flag.

    Subscribers are called in the publishing thread (the job's driver thread); a subscriber that raises is dropped
    with its error kept in ``subscriber_errors`` (a broken widget must not kill training).
    """

    events: list = field(default_factory=list)
    subscriber_errors: list = field(default_factory=list)

    def __post_init__(self):
        self._lock = threading.Lock()
        self._subscribers: list[Callable] = []
        self._cancel = threading.Event()
        self._finished = threading.Event()

    def subscribe(self, callback: Callable[[ProgressEvent], None], replay: bool = True) -> Callable[[], None]:
        """Call ``callback(event)`` for every event (first the ones already published, if ``replay``).

        Returns a function that unsubscribes.
        """
        with self._lock:
            past = list(self.events) if replay else []
            self._subscribers.append(callback)
        for ev in past:
            self._deliver(callback, ev)

        def unsubscribe():
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)
        return unsubscribe

    def publish(self, event: ProgressEvent) -> None:
        with self._lock:
            self.events.append(event)
            subs = list(self._subscribers)
            if event.kind in ("done", "cancelled", "error"):
                self._finished.set()
        for cb in subs:
            self._deliver(cb, event)

    def _deliver(self, cb, event):
        try:
            cb(event)
        except Exception as e:  # noqa: BLE001 - a subscriber's bug is reported, never raised into the driver
            self.subscriber_errors.append(e)
            with self._lock:
                if cb in self._subscribers:
                    self._subscribers.remove(cb)

    def cancel(self) -> None:
        """Ask the job to stop at the end of the current step."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def wait_finished(self, timeout: float | None = None) -> bool:
        return self._finished.wait(timeout)

    @property
    def losses(self) -> list[float]:
        """The loss of every step, in order; a restart drops the steps after the checkpoint it went back to."""
        out: list[float] = []
        with self._lock:
            events = list(self.events)
        for ev in events:
            if ev.kind == "step":
                out.append(ev.loss)
            elif ev.kind == "restart":
                del out[ev.step:]
        return out

    @property
    def last(self) -> ProgressEvent | None:
        with self._lock:
            return self.events[-1] if self.events else None
