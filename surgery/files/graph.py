"""ONNX files on disk: find, load, tap and size them. Weights stay on disk until something reads them."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import onnx_ir as ir

from surgery.errors import SurgeryError
from surgery.files import canonical, output, validation

MODEL_FILE = "model.onnx"


def resolve(path: str | Path) -> Path:
    """Return the .onnx file behind `path`: the file itself, or model.onnx inside a folder."""
    path = Path(path)
    if path.is_dir():
        candidate = path / MODEL_FILE
        if candidate.is_file():
            return candidate
        found = sorted(path.glob("*.onnx"))
        if len(found) == 1:
            return found[0]
        if not found:
            raise SurgeryError(f"found no .onnx file in {path}; export one with `surgery export`")
        names = ", ".join(f.name for f in found)
        raise SurgeryError(f"found several .onnx files in {path} ({names}); pass the one you mean")
    if not path.exists():
        raise SurgeryError(f"{path} does not exist; pass an .onnx file or a folder from `surgery export`")
    return path


def load(path: str | Path) -> ir.Model:
    """Load an ONNX model in the plain view every pass works on (canonical.on_load: residual adds fused into
    normalisations split out, ...); `save` writes it back in the input's own ops. External data is
    referenced, not read into memory."""
    file = resolve(path)
    return canonical.on_load(read(file), file.parent)


def read(path: str | Path) -> ir.Model:
    """The ONNX model at `path` as it is on disk, checked (validation.check) before anything uses it."""
    file = resolve(path)
    try:
        model = ir.load(file)
    except Exception as e:  # protobuf raises DecodeError; onnx_ir may raise others on bad content
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SurgeryError(
            f"cannot read {file} as an ONNX model ({reason}); pass an .onnx file written by an ONNX exporter"
        ) from None
    validation.check(model, file)
    return model


def external_data(model: ir.Model) -> dict[str, Path]:
    """Each external data file the model reads: its location (relative to the model file) -> the folder it is in."""
    found = {}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            found[tensor.location] = Path(tensor.base_dir)
    return dict(sorted(found.items()))


def external_data_files(model: ir.Model) -> list[Path]:
    """Paths of the files holding the model's external initializer data."""
    return [(base / location).resolve() for location, base in external_data(model).items()]


def size_on_disk(model: ir.Model, path: str | Path) -> int:
    """Bytes of the .onnx file plus its external data files."""
    return resolve(path).stat().st_size + sum(f.stat().st_size for f in external_data_files(model) if f.exists())


def save(model: ir.Model, dest: str | Path, extra: dict[str, str | bytes] | None = None) -> None:
    """Write `model` to `dest` atomically, with `extra` files (name -> text or bytes) beside it.

    The model is written back in the input's own ops (the plain view `load` made is undone on a copy; the model
    passed in is not modified). External data it references is copied beside `dest` byte for byte (the kernel
    copies; weights are never read into this process), unless the model now uses less than half of a file's bytes
    (a pass replaced most of its weights): then the tensors it still uses are written anew instead, so the output
    holds no dead weights. New weights go, once, to their own data file (`<dest name>.data`, those of 1 MiB or more,
    when the model has external data or over 1 GiB of weights in memory; else all weights stay in the .onnx file).

    Args:
        model: the model to write, e.g. a pass's `SurgeryResult.model`.
        dest: the .onnx file to write (its folder is made when missing); files of the same names there are replaced.
        extra: files to write beside `dest`, name -> text (written as text) or bytes.

    Raises:
        SurgeryError: the disk is full or the folder cannot be written (one line; nothing is left half-written).
    """
    dest = Path(dest)
    model = canonical.on_save(model.clone())  # weights shared, not copied
    with output.file(dest, needed=lambda: _bytes(model)) as partial:
        _write_extra(partial, extra)
        used = _referenced_bytes(model)
        sparse = set()
        for location, base in external_data(model).items():
            src, target = base / location, dest.parent / location
            if target.exists() and target.resolve() == src.resolve():
                continue  # written next to its own data, which is unchanged
            if used[location] < src.stat().st_size / 2:
                sparse.add(location)
                continue
            (partial / location).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, partial / location)
        if external_data(model) or _inline_bytes(model) > _INLINE_LIMIT:  # a protobuf cannot hold 2 GB
            taken = (set(external_data(model)) - sparse) | {p.name for p in dest.parent.iterdir()}
            location = next(n for n in (f"{dest.name}.data", *(f"{dest.name}.{i}.data" for i in range(2, 10_000))) if n not in taken)
            with _weights_external(model, partial, location, rewrite=sparse):
                ir.save(model, partial / dest.name)
        else:
            ir.save(model, partial / dest.name)


@contextlib.contextmanager
def _weights_external(model: ir.Model, folder: Path, location: str, rewrite: set[str], minimum: int = 1 << 20):
    """While saving, reference from folder/location (written once, 4 KiB aligned) each in-memory weight
    of >= `minimum` bytes and each weight held in an external file named in `rewrite`."""
    moved = {}
    with open(folder / location, "wb") as f:
        for name, value in model.graph.initializers.items():
            tensor = value.const_value
            if tensor is None:
                continue
            if isinstance(tensor, ir.ExternalTensor) and tensor.location not in rewrite:
                continue
            if not isinstance(tensor, ir.ExternalTensor) and tensor.nbytes < minimum:
                continue
            f.seek(-f.tell() % 4096, 1)
            offset = f.tell()
            f.write(tensor.tobytes())
            moved[name] = tensor
            value.const_value = ir.ExternalTensor(
                location, offset=offset, length=tensor.nbytes, dtype=tensor.dtype, shape=tensor.shape, name=name, base_dir=folder
            )
            if isinstance(tensor, ir.ExternalTensor):
                tensor.release()  # its pages were read once to be written; keep them out of memory
    if not moved:
        (folder / location).unlink()
    try:
        yield
    finally:
        for name, tensor in moved.items():
            model.graph.initializers[name].const_value = tensor


def _referenced_bytes(model: ir.Model) -> dict[str, int]:
    """Bytes of each external data file (by location) that the model's weights still reference."""
    used: dict[str, int] = {}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            used[tensor.location] = used.get(tensor.location, 0) + tensor.nbytes
    return used


def write(model: ir.Model, out: str | Path, like: str | Path, extra: dict[str, str | bytes] | None = None) -> Path:
    """Write a rewritten model the way its input `like` was given: a folder in gives a folder out
    (model.onnx plus the input folder's config and tokenizer files), a file in gives a file out.
    `extra` files (name -> text or bytes) go into the folder, or beside the file.
    Never writes over the input; the output appears complete or not at all.

    Args:
        model: the rewritten model, e.g. a pass's `SurgeryResult.model` (weights are written as `save` does).
        out: the output: a folder (replaced as a whole when it exists) for a folder `like`, else an .onnx file.
        like: the model's input as it was given, a folder or an .onnx file: what the output copies its form and files from.
        extra: files to write into the output folder (or beside the output file), name -> text or bytes.

    Returns:
        The path of the written .onnx file: `out/model.onnx` for a folder, else `out`.

    Raises:
        SurgeryError: `like` holds no ONNX model, `out` would overwrite the input, `out` is a folder for a file
            input (or a file for a folder input), its folder cannot be written, or the disk is too full for it.
    """
    like, out = Path(like), Path(out)
    check_output(out, like, model)
    source = resolve(like)
    if not like.is_dir():
        save(model, out, extra)
        return out
    skip = {source.name} | {p.name for p in external_data_files(model)}
    with output.folder(out, needed=lambda: _bytes(model)) as partial:
        for item in like.iterdir():
            if item.is_file() and item.name not in skip and item.suffix not in (".onnx", ".onnx_data", ".data"):
                shutil.copy2(item, partial / item.name)
        _write_extra(partial, extra)
        save(model, partial / MODEL_FILE)
    return out / MODEL_FILE


def _write_extra(folder: Path, extra: dict[str, str | bytes] | None) -> None:
    for name, content in (extra or {}).items():
        if isinstance(content, bytes):
            (folder / name).write_bytes(content)
        else:
            (folder / name).write_text(content)


def check_output(out: str | Path, like: str | Path, model: ir.Model | None = None) -> None:
    """Refuse, before any work, an output path that `write(model, out, like)` could not honour."""
    like, out = Path(like), Path(out)
    source = resolve(like)
    if out.resolve() in (source.resolve(), like.resolve()) or (like.is_dir() and source.resolve().is_relative_to(out.resolve())):
        raise SurgeryError(f"-o {out} would overwrite the input {like}; choose another output path")
    if not like.is_dir() and out.is_dir():
        raise SurgeryError(f"-o {out} is a folder but the input is a file; pass a file name like {out / source.name}")
    if like.is_dir() and out.exists() and not out.is_dir():
        raise SurgeryError(f"-o {out} is a file but the input is a folder; pass a folder path")
    output.check(out, needed=None if model is None else _bytes(model))


_INLINE_LIMIT = 1 << 30


def _bytes(model: ir.Model) -> int:
    """What writing `model` takes on disk, about: its weights in memory and its external data files."""
    return _inline_bytes(model) + sum(f.stat().st_size for f in external_data_files(model) if f.exists())


def _inline_bytes(model: ir.Model) -> int:
    return sum(
        v.const_value.nbytes
        for v in model.graph.initializers.values()
        if v.const_value is not None and not isinstance(v.const_value, ir.ExternalTensor)
    )
