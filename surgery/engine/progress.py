"""The progress callbacks of the long steps, one name per shape. The CLI hands the library a Tell (its progress bars);
a step that counts in other units turns it into its own shape (counter, or a lambda naming the stage)."""

from __future__ import annotations

from collections.abc import Callable

Tell = Callable[[str, int, int], None]  # tell(stage, done, total): the CLI's bars; job, select, diagnose, evaluate.side_by_side
Count = Callable[[int, int], None]  # count(done, total) within one stage: the compensation fit's windows
Step = Callable[[int], None]  # step(n): n more units done: windows scored, latency repeats


def silent(stage: str, done: int, total: int) -> None:
    """A Tell for no one."""


def counter(tell: Tell, stage: str, total: int) -> Step:
    """Turn tell(stage, done, total) into step(n), which counts n more done."""
    done = 0

    def step(n: int) -> None:
        nonlocal done
        done += n
        tell(stage, done, total)

    return step
