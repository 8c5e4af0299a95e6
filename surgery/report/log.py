"""Progress as lines of a log, for when stderr is not a terminal (CI, nohup, a job scheduler): a line when a stage
starts, one every `every` seconds while it runs (from the last count it reported, or that it is still on it), and one
when it ends; between stages, a line every `every` seconds that the run is still working. On a terminal the CLI draws
progress bars instead."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable


@dataclasses.dataclass
class _Stage:
    total: int
    start: float
    done: int = 0
    said: float = 0.0  # when its last line was written


class Log:
    """A Tell (progress(stage, done, total)) that writes lines through `write`, and a heartbeat thread that writes the
    current stage's state when `every` seconds pass without a line. Use it as a context manager (the heartbeat stops
    on exit)."""

    def __init__(self, write: Callable[[str], None], every: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.write, self.every, self.clock = write, every, clock
        self.stages: dict[str, _Stage] = {}
        self.current: str | None = None
        self.last: str | None = None  # the stage that ended last
        self.start = self.said = clock()  # when the log began; when it last wrote a line
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self) -> "Log":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def __call__(self, stage: str, done: int, total: int) -> None:
        with self.lock:
            now = self.clock()
            state = self.stages.get(stage)
            if state is None:
                state = self.stages[stage] = _Stage(total, now)
                self.current = stage
                self._say(stage, state, now, f"started ({total} steps)")
            state.done, state.total = done, total
            if done >= total:
                self._say(stage, state, now, f"done in {_duration(now - state.start)}")
                self.current, self.last = (None, stage) if self.current == stage else (self.current, self.last)
            elif now - state.said >= self.every:
                self._say(stage, state, now, self._progress(state, now))

    def beat(self) -> None:
        """Write the current stage's state, or between stages that the run is still working, if no line was written
        for `every` seconds (the heartbeat calls it)."""
        with self.lock:
            now = self.clock()
            if now - self.said < self.every:
                return
            state = self.stages.get(self.current) if self.current else None
            if state is not None:
                self._say(self.current, state, now, self._progress(state, now))
            else:
                after = f"{self.last} ended {_duration(now - self.stages[self.last].said)} ago" if self.last else "no step has reported yet"
                self.said = now
                self.write(f"still working after {_duration(now - self.start)} ({after})")

    def _beat(self) -> None:
        while not self.stop.wait(min(self.every, 1.0) if self.every > 0 else 1.0):
            self.beat()

    def _say(self, stage: str, state: _Stage, now: float, what: str) -> None:
        state.said = self.said = now
        self.write(f"{stage}: {what}")

    @staticmethod
    def _progress(state: _Stage, now: float) -> str:
        elapsed = now - state.start
        share = state.done / state.total if state.total else 0.0
        left = f", about {_duration(elapsed * (1 - share) / share)} left" if share > 0 else ""
        return f"{state.done}/{state.total} ({100 * share:.0f} %) after {_duration(elapsed)}{left}"


def _duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds // 60:.0f} min {seconds % 60:.0f} s"
