"""Memory: how much a step may take (--fit-memory) and how much the machine has free now."""

from __future__ import annotations

import os
import re

from surgery.errors import SurgeryError

MEMORY_BYTES = 2 << 30  # the fit's normal equations' bound when the available memory cannot be read (--fit-memory auto: a quarter of it)
MEMORY_SHARE = 0.25
UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def memory_bound(text: str | int | None) -> int:
    """--fit-memory: bytes the normal equations of one pass may take: `auto` (a quarter of the memory available
    now, at least 256 MiB), or a size such as 512M, 4G, 1.5GiB."""
    if text is None or str(text).strip().lower() == "auto":
        free = available_memory()
        return MEMORY_BYTES if free is None else max(int(MEMORY_SHARE * free), 256 << 20)
    if isinstance(text, int):
        size = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
        if match is None:
            raise SurgeryError(f"cannot read --fit-memory {text!r}: give a size such as 512M or 4G, or auto")
        size = int(float(match.group(1)) * UNITS[match.group(2)])
    if size <= 0:
        raise SurgeryError(f"--fit-memory {text!r}: give a positive size such as 512M or 4G, or auto")
    return size


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation now: Linux's MemAvailable (free memory and the page cache
    it can drop, such as the model files just read), else the free pages; None when neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
