"""Checkpoints: a long run's finished units, kept in a work folder beside its output so that a run stopped by a fault
(a node taken back, an out-of-memory kill, Ctrl-C) resumes where it stopped.

    with Checkpoints.open(out, fingerprint) as work:    # OUT.work/: made, resumed, or refused when it does not match; locked
        state = work.load("fit/chunk-0")                # None until that unit is done
        work.save("fit/chunk-0", {"results": ..., "streams": ...})
        work.finish()                                   # the run wrote its output: the folder goes

A unit is one file, `<unit>.npz`, written atomically (a temporary file renamed over it): its arrays stored as
arrays and the rest as JSON, read back without pickle, so a work folder can run no code. Only the classes that
registered themselves with `@checkpointable` (the fit's sums and results, the trials' numbers: data only) are rebuilt
from it; each registers where it is defined, so this module names no stage above it.

The folder is tied to a fingerprint (the model's bytes, the windows' tokens, the options that change results,
surgery's version): `manifest.json`. A run whose fingerprint differs is refused in one line naming what
differs; `restart` discards the folder instead. A finished run removes it, so a folder that exists is always
an interrupted run's.

Mid-pass snapshots (`due`) are spaced so that writing them costs at most 1 / RATIO of the time between them (the
cost of the next one foreseen from its bytes and the slowest rate a save has had, RATE before the first) and they
come at most every `every` seconds (SURGERY_CHECKPOINT_SECONDS; 0: at every unit, for tests).

Tests stop a run at a named unit: with SURGERY_PAUSE_AT set to a unit's name (a glob) and SURGERY_PAUSE_FILE to a
path, the process that reaches that unit first writes its pid to the file and sleeps until it is killed; once the
file exists, the unit passes (a restarted worker or a resumed run goes on). SURGERY_PAUSE_SKIP=k lets the first k
matches in a process pass.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from surgery.errors import SurgeryError
from surgery.files import output
from surgery.version import __version__

FORMAT = 1
MANIFEST = "manifest.json"
LOCK = "lock"  # flock'ed by the run using the folder
RATIO = 50  # a snapshot costs at most 1 / RATIO of the work since the last one: 2 %
EVERY = 60.0  # seconds between mid-pass snapshots, at least (SURGERY_CHECKPOINT_SECONDS)
RATE = 100e6  # bytes per second a save is assumed to write before one has been timed
TYPES: dict[tuple[str, str], type] = {}  # the classes a checkpoint may rebuild, by (module, name): see checkpointable


def checkpointable(cls: type) -> type:
    """Class decorator: checkpoints may hold instances of `cls` (a dataclass of data only: its fields are stored and set
    again on load, no code runs). The class registers itself where it is defined, so files/ imports no stage above it."""
    TYPES[(cls.__module__, cls.__qualname__)] = cls
    return cls


class Checkpoints:
    """A run's work folder (None: checkpoints off, every call does nothing): finished units by name."""

    def __init__(self, folder: Path | None, every: float | None = None, prefix: str = ""):
        self.folder, self.prefix = folder, prefix
        self.every = float(os.environ.get("SURGERY_CHECKPOINT_SECONDS", EVERY)) if every is None else every
        self._last, self._cost, self._rate = time.perf_counter(), 0.0, RATE  # the last save's end and seconds; the slowest bytes/s
        self.loaded: list[str] = []  # the units this run read back: what it resumed from
        self.cost = {"seconds": 0.0, "bytes": 0, "units": 0}  # what writing units has cost this run (shared by its scopes)
        self._lock: int | None = None  # the descriptor holding the folder's lock (open's)

    @classmethod
    def off(cls) -> "Checkpoints":
        return cls(None)

    @classmethod
    def open(cls, out: str | Path, fingerprint: dict[str, Any], restart: bool = False, every: float | None = None) -> "Checkpoints":
        """The work folder of the output `out` (`OUT.work`, beside it): made when missing, resumed when its fingerprint
        (with surgery's version added) matches; discarded first with `restart`.

        The folder is locked while this process uses it, so two runs writing the same output never share it.

        Raises:
            SurgeryError: it holds another run's work (named: what differs), another run is using it, or it cannot be made.
        """
        folder = work_folder(out)
        fingerprint = json.loads(json.dumps({"surgery": __version__, **fingerprint}))  # as the manifest reads back
        existed = folder.exists()
        lock = _claim(folder) if existed else None
        if restart and existed:
            if lock is not None:
                os.close(lock)
            shutil.rmtree(folder)
            existed, lock = False, None
        manifest = folder / MANIFEST
        if existed:
            try:
                found = json.loads(manifest.read_text())
            except (OSError, ValueError):
                found = None
            if not isinstance(found, dict) or found.get("format") != FORMAT or not isinstance(found.get("fingerprint"), dict):
                raise SurgeryError(f"{folder} is not a work folder this surgery can read; delete it, or add --restart to discard it")
            if found["fingerprint"] != fingerprint:
                differ = [k for k in sorted(set(fingerprint) | set(found["fingerprint"])) if fingerprint.get(k) != found["fingerprint"].get(k)]
                raise SurgeryError(f"{folder} holds the work of a run with another {', '.join(differ)}; rerun with that run's inputs "
                                   "and options to resume it, or add --restart to discard it")
        else:
            try:
                folder.mkdir(parents=True)
                lock = _claim(folder)
                text = json.dumps({"format": FORMAT, "fingerprint": fingerprint}, indent=2).encode()
                _atomic(manifest, lambda f: f.write(text))
            except OSError as e:
                raise SurgeryError(f"cannot make the work folder {folder} ({e.strerror or e}); choose an output where you can write") from None
        work = cls(folder, every)
        work._lock = lock
        return work

    def scope(self, name: str) -> "Checkpoints":
        """The same folder, its units under `name/` (one per step that keeps units: fit, trials, ...)."""
        scoped = Checkpoints(self.folder, self.every, f"{self.prefix}{name}/")
        scoped.loaded, scoped.cost = self.loaded, self.cost
        return scoped

    def load(self, unit: str) -> Any | None:
        """What `save` kept under `unit`, or None when that unit is not done."""
        if self.folder is None:
            return None
        path = self._path(unit)
        try:
            with np.load(path, allow_pickle=False) as stored:
                meta = json.loads(str(stored["meta"]))
                value = _decode(meta, stored)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SurgeryError(f"cannot read the checkpoint {path} ({e}); add --restart to discard the work folder") from None
        self.loaded.append(self.prefix + unit)
        return value

    def save(self, unit: str, value: Any) -> None:
        """Keep `value` (arrays, numbers, strings, lists, dicts, and the checkpointable dataclasses) as unit `unit`, atomically."""
        if self.folder is None:
            return
        start = time.perf_counter()
        arrays: list[np.ndarray] = []
        meta = _encode(value, arrays)
        path = self._path(unit)
        with output.disk_errors(path, needed=sum(a.nbytes for a in arrays)):  # a full disk: one line (--no-checkpoints)
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic(path, lambda f: np.savez(f, meta=np.array(json.dumps(meta)), **{f"a{i}": a for i, a in enumerate(arrays)}))
        self._last = time.perf_counter()
        self._cost = self._last - start
        size = path.stat().st_size
        self.cost["seconds"] += self._cost
        self.cost["bytes"] += size
        self.cost["units"] += 1
        if size > 1 << 20:  # a rate from a save big enough to time
            self._rate = min(self._rate, size / max(self._cost, 1e-9))

    def resumed(self) -> dict[str, int]:
        """How many finished units this run read back, by step (the first part of their names): {} for a fresh run."""
        counts: dict[str, int] = {}
        for unit in self.loaded:
            counts[unit.split("/")[0]] = counts.get(unit.split("/")[0], 0) + 1
        return counts

    def due(self, nbytes: int = 0) -> bool:
        """Whether a mid-pass snapshot of about `nbytes` is due: `every` seconds since the last save, and RATIO times what
        the last save took and what this one will take at the slowest rate seen."""
        if self.folder is None or self.every <= 0:  # every 0: a snapshot at every unit (tests)
            return self.folder is not None
        return time.perf_counter() - self._last >= max(self.every, RATIO * max(self._cost, nbytes / self._rate))

    def drop(self, unit: str) -> None:
        """Remove a unit that a later one replaces (a pass's snapshot, once the pass's result is kept)."""
        if self.folder is not None:
            self._path(unit).unlink(missing_ok=True)

    def finish(self) -> None:
        """The run is done (its output written): remove the work folder."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.close()

    def close(self) -> None:
        """Let another run (or this process again) use the folder: release its lock."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _path(self, unit: str) -> Path:
        return self.folder / f"{self.prefix}{unit}.npz"


def work_folder(out: str | Path) -> Path:
    """Where the run writing `out` keeps its checkpoints: `OUT.work`, beside it."""
    out = Path(out)
    return out.with_name(out.name + ".work")


def digest(*parts: bytes | np.ndarray | str) -> str:
    """A short sha256 of the parts (arrays by their bytes, dtype and shape)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(f"{part.dtype}{part.shape}".encode())
            part = np.ascontiguousarray(part).tobytes()
        h.update(part.encode() if isinstance(part, str) else part)
    return h.hexdigest()[:16]


def model_digest(model_path: str | Path, model) -> str:
    """A short sha256 of a model's bytes: its .onnx file and its external data files, in order."""
    from surgery.files import graph

    h = hashlib.sha256()
    for path in [graph.resolve(model_path), *graph.external_data_files(model)]:
        with open(path, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()[:16]


_hits: dict[str, int] = {}


def reached(unit: str) -> None:
    """A named point of a run (tests stop a run here: the module docstring); does nothing unless SURGERY_PAUSE_AT names it."""
    pattern, path = os.environ.get("SURGERY_PAUSE_AT"), os.environ.get("SURGERY_PAUSE_FILE")
    if not pattern or not path or not fnmatch.fnmatchcase(unit, pattern) or os.path.exists(path):
        return
    _hits[pattern] = _hits.get(pattern, 0) + 1
    if _hits[pattern] <= int(os.environ.get("SURGERY_PAUSE_SKIP", "0")):
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)  # one process pauses, even when several reach it
    except FileExistsError:
        return
    os.write(fd, f"{os.getpid()} {unit}".encode())
    os.close(fd)
    while True:
        time.sleep(60)


def _claim(folder: Path) -> int | None:
    """An exclusive lock on the folder's lock file, held until it is closed or this process ends (however it ends);
    None where the system has no flock."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(folder / LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as e:
        raise SurgeryError(f"cannot use the work folder {folder} ({e.strerror or e}); choose an output where you can write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SurgeryError(f"{folder} is in use by another run writing the same output; wait for it to finish, or choose another -o") from None
    return fd


def _atomic(path: Path, write) -> None:
    """Make `path` whole or not at all: write(f) fills a temporary file beside it, which is then renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _encode(value: Any, arrays: list[np.ndarray]) -> Any:
    """`value` as JSON, its arrays (and long tuples of numbers) appended to `arrays` and named by index."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, str, int, float)):
        return value
    if isinstance(value, np.ndarray):
        arrays.append(value)
        return {"array": len(arrays) - 1}
    if isinstance(value, (tuple, list)):
        numbers = len(value) > 8 and all(type(x) in (int, float) for x in value) and len({type(x) for x in value}) == 1
        if numbers:
            arrays.append(np.asarray(value))
            return {"numbers": len(arrays) - 1, "tuple": isinstance(value, tuple)}
        return {"items": [_encode(x, arrays) for x in value], "tuple": isinstance(value, tuple)}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, arrays), _encode(v, arrays)] for k, v in value.items()]}
    kind = (type(value).__module__, type(value).__qualname__)
    if kind not in TYPES:
        raise TypeError(f"a checkpoint cannot hold a {kind[0]}.{kind[1]}")
    fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)} if dataclasses.is_dataclass(value) else vars(value)
    return {"type": list(kind), "fields": {k: _encode(v, arrays) for k, v in fields.items()}}


def _decode(meta: Any, stored) -> Any:
    if not isinstance(meta, dict):
        return meta
    if "array" in meta:
        return stored[f"a{meta['array']}"]
    if "numbers" in meta:
        items = stored[f"a{meta['numbers']}"].tolist()
        return tuple(items) if meta["tuple"] else items
    if "items" in meta:
        items = [_decode(x, stored) for x in meta["items"]]
        return tuple(items) if meta["tuple"] else items
    if "dict" in meta:
        return {_decode(k, stored): _decode(v, stored) for k, v in meta["dict"]}
    kind = tuple(meta["type"])
    cls = TYPES.get(kind)
    if cls is None:  # not checkpointable, or its module is not loaded: the run that reads it never imported it
        raise TypeError(f"a checkpoint names the type {'.'.join(kind)}, which no loaded module registered as checkpointable")
    obj = object.__new__(cls)
    obj.__dict__.update({k: _decode(v, stored) for k, v in meta["fields"].items()})
    return obj
