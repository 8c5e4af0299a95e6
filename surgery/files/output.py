"""Outputs on disk: each appears whole or not at all, and a failed write is one line, not a traceback.

Every file or folder surgery writes is first built under a hidden sibling, `.NAME.partial-PID`, then
renamed into place. A failure (a full disk, no permission, Ctrl-C, SIGTERM) removes the partial; a
process killed outright (`kill -9`) cannot, so each write first sweeps the partials whose process is gone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from surgery.errors import SurgeryError

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?:partial|old)-(?P<pid>\d+)$")
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NOT_ALLOWED = {errno.EACCES, errno.EPERM, errno.EROFS}


def check(target: str | Path, needed: int | None = None) -> None:
    """Refuse, before any work, an output whose folder cannot be written or has less than `needed` bytes
    free; sweep stale partials beside it."""
    target = Path(target)
    parent = _existing_ancestor(target.parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SurgeryError(f"cannot write {target}: permission denied in {parent}; choose an -o you can write to")
    if needed is not None and shutil.disk_usage(parent).free < needed:
        raise SurgeryError(explain(OSError(errno.ENOSPC, "No space left on device"), target, needed))
    if target.parent.is_dir():
        sweep(target)


def sweep(target: str | Path) -> list[Path]:
    """Remove `.NAME.partial-PID` / `.NAME.old-PID` siblings of `target` whose process is gone; return them."""
    target = Path(target)
    removed = []
    try:
        siblings = list(target.parent.iterdir())
    except OSError:
        return removed
    for item in siblings:
        match = _LEFTOVER.match(item.name)
        if match is None or match["name"] != target.name or _alive(int(match["pid"])):
            continue
        if item.is_dir() and not item.is_symlink():
            shutil.rmtree(item, ignore_errors=True)
        else:
            item.unlink(missing_ok=True)
        removed.append(item)
    return removed


@contextlib.contextmanager
def folder(out: str | Path, needed: Callable[[], int] | int | None = None) -> Iterator[Path]:
    """Yield an empty hidden folder to fill; on success it replaces `out`, on any failure it is removed.
    `needed` (bytes, or a function giving them) is quoted when the disk is full."""
    out = Path(out)

    def commit(partial: Path) -> None:
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            partial.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            partial.rename(out)

    with _staged(out, needed, commit) as partial:
        yield partial


@contextlib.contextmanager
def file(dest: str | Path, needed: Callable[[], int] | int | None = None) -> Iterator[Path]:
    """Yield a hidden folder to write `dest` (and files beside it, such as its external data) into, under
    their final names; on success each is moved beside `dest`, `dest` itself last."""
    dest = Path(dest)

    def commit(partial: Path) -> None:
        for item in sorted(partial.iterdir(), key=lambda p: p.name == dest.name):
            os.replace(item, dest.parent / item.name)

    with _staged(dest, needed, commit) as partial:
        yield partial


@contextlib.contextmanager
def _staged(target: Path, needed, commit: Callable[[Path], None]) -> Iterator[Path]:
    """The hidden partial folder of `target`: yielded to fill, then `commit`ted; removed whatever happens."""
    with disk_errors(target, needed):
        partial = _partial(target)
        try:
            partial.mkdir()
            yield partial
            commit(partial)
        finally:
            shutil.rmtree(partial, ignore_errors=True)


@contextlib.contextmanager
def disk_errors(target: str | Path, needed: Callable[[], int] | int | None = None) -> Iterator[None]:
    """Turn a full disk or a refused write under `target` into one SurgeryError line."""
    try:
        yield
    except OSError as e:
        line = explain(e, target, needed)
        if line is None:
            raise
        raise SurgeryError(line) from None


def explain(e: OSError, target: str | Path | None = None, needed: Callable[[], int] | int | None = None) -> str | None:
    """One line for an OSError a user can cause (a full disk, no permission), else None.
    `needed` (bytes, or a function giving them) is quoted when the disk is full."""
    target = Path(target if target is not None else e.filename or ".")
    if e.errno in _NOT_ALLOWED:
        return f"cannot write {_shown(target)}: {e.strerror.lower()}; choose an -o you can write to"
    if e.errno not in _NO_SPACE:
        return None
    where = _existing_ancestor(target.parent)
    try:
        size = needed() if callable(needed) else needed
    except Exception:  # noqa: BLE001 - the size is only quoted in the message
        size = None
    need = f"about {_mb(size)} needed, " if size else ""
    free = _mb(shutil.disk_usage(where).free)
    return f"no space left on the device writing {_shown(target)} ({need}{free} free in {where}); free some space or choose another -o"


def _shown(path: Path) -> Path:
    """`path` as the user named it: a partial folder on the way is shown under its final name."""
    return Path(*(_LEFTOVER.sub(r"\g<name>", part) for part in path.parts))


def _mb(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _partial(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep(target)
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    return partial


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while (not path.exists() or _LEFTOVER.match(path.name)) and path != path.parent:
        path = path.parent
    return path


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
