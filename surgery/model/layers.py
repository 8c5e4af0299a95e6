"""Layer specs: `all`, `3`, `0-5,9`, `-1` (the last block) -> sorted block indices."""

from __future__ import annotations

import re

from surgery.errors import SurgeryError

_ITEM = re.compile(r"^(-?\d+)$|^(\d+)-(\d+)$")


def parse_layers(spec: str, n_layers: int) -> tuple[int, ...]:
    """Read a layer spec against a model with `n_layers` blocks.

    `all` is every block, `none` or an empty string no block; items are separated by commas and are
    an index (negative counts from the end) or an inclusive range `a-b`.
    """
    text = spec.strip().lower()
    if text == "all":
        return tuple(range(n_layers))
    if text in ("", "none"):
        return ()
    chosen: set[int] = set()
    for item in text.replace(" ", "").split(","):
        match = _ITEM.match(item)
        if match is None:
            raise SurgeryError(f"cannot read --layers {spec!r}; write it like 0-3,7 or -1 or all")
        if match.group(1) is not None:
            index = int(match.group(1))
            chosen.add(checked(index, n_layers, spec))
        else:
            start, stop = int(match.group(2)), int(match.group(3))
            if stop < start:
                raise SurgeryError(f"--layers range {item} runs backwards; write it low-high, like {stop}-{start}")
            checked(stop, n_layers, spec)
            chosen.update(range(start, stop + 1))
    return tuple(sorted(chosen))


def format_layers(layers) -> str:
    """(0, 1, 2, 5) -> '0-2,5', the inverse of parse_layers."""
    layers = sorted(layers)
    parts, i = [], 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        parts.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
        i = j + 1
    return ",".join(parts) or "none"


def checked(index: int, n_layers: int, spec: str | None = None) -> int:
    """A layer index (negative counts from the end) as a non-negative one, or an error saying it is out of range."""
    if not -n_layers <= index < n_layers:
        where = f" in --layers {spec!r}" if spec is not None else ""
        raise SurgeryError(
            f"layer {index}{where} is out of range: the model has {n_layers} blocks (0-{n_layers - 1}, or -{n_layers} to -1)"
        )
    return index % n_layers
