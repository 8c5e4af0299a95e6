"""The built-in calibration corpus: several kinds of English text that every machine running surgery has offline,
and text the model writes itself.

A fix fitted on one kind of text holds its budget on that kind, not beyond it; methods that calibrate on data
(GPTQ, SLEB, ReplaceMe) calibrate on broad text for this reason. Without a network the broadest text a machine
surely has is the model's own: `samples` draws windows from it at temperature 1 from BOS, text from the
distribution it was trained on (self-calibration, Williams et al. 2025, found such samples calibrate quantization
and pruning as well as real text). Beside them the default corpus mixes what Python and surgery's dependencies ship:

    reference   the Python language reference (`pydoc_data.topics`, in every CPython)
    library     the standard library's own documentation (module, class and function docstrings of LIBRARY's modules)
    science     NumPy's documentation of its numerical, statistical and linear-algebra routines (prose sections)
    legal       the licenses Python and the dependencies ship (distinct paragraphs)
    readme      the dependencies' project descriptions (their README, from the installed metadata)

Each kind is cut at paragraph boundaries into pieces of about PIECE characters, at most SHARE characters of it are
used (so that no kind outweighs the others), and each kind's pieces are spread evenly over the corpus, so that every
segment of the token stream, and with it the fit, selection and evaluation parts, holds every kind (data.py deals
segments of 8 windows; a piece is about two windows). Sources are read from files (ast for docstrings), nothing is
imported but pydoc_data; a kind that a machine lacks is left out. The corpus depends on the versions installed:
a checkpoint's fingerprint holds the token ids, so a resumed run never mixes two. data.windows puts the two
together: a share SAMPLED of every part's windows are samples, the rest windows of the text.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import re
import sysconfig
from pathlib import Path

import numpy as np

SAMPLED = 0.5  # the share of the default corpus's windows that are the model's own samples
PIECE = 2000  # characters per piece (about two 256-token windows)
SHARE = 160_000  # characters of each kind at most
DEPENDENCIES = ("numpy", "onnx", "onnxruntime", "onnxruntime-gpu", "onnx-ir", "onnxscript", "tokenizers", "typer",
                "rich", "matplotlib", "threadpoolctl", "click", "pillow", "markdown-it-py", "pygments")
LIBRARY = ("argparse", "asyncio/events", "bisect", "calendar", "collections/__init__", "contextlib", "csv", "dataclasses",
           "datetime", "decimal", "difflib", "email/message", "enum", "fractions", "functools", "heapq", "http/client",
           "http/cookiejar", "inspect", "io", "ipaddress", "itertools", "json/__init__", "logging/__init__", "mailbox",
           "numbers", "optparse", "pathlib", "pickle", "pprint", "queue", "random", "re/__init__", "sched", "shutil",
           "smtplib", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
           "typing", "unittest/case", "urllib/parse", "uuid", "warnings", "weakref", "zipfile/__init__")
SCIENCE = ("numpy/lib/_function_base_impl", "numpy/lib/_histograms_impl", "numpy/lib/_polynomial_impl", "numpy/lib/_nanfunctions_impl",
           "numpy/linalg/_linalg", "numpy/fft/_pocketfft", "numpy/fft/__init__", "numpy/polynomial/polynomial",
           "numpy/polynomial/chebyshev", "numpy/polynomial/legendre", "numpy/polynomial/hermite", "numpy/polynomial/laguerre",
           "numpy/polynomial/_polybase", "numpy/_core/fromnumeric", "numpy/_core/numeric", "numpy/_core/_add_newdocs",
           "numpy/random/__init__", "numpy/ma/core", "numpy/lib/_arraysetops_impl")  # NumPy 2 paths; missing ones are skipped
CODE_SECTIONS = re.compile(r"\n\s*(Examples|See Also|Parameters|Returns|Raises|Yields|Attributes|Other Parameters)\n\s*-{3,}\n")


def reference() -> list[str]:
    """The Python language reference: `pydoc_data.topics`, in sorted key order (the corpus before the mix)."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def _docstrings(path: Path, prose_only: bool) -> list[str]:
    """The docstrings of a source file (module, classes, functions), read with ast (no import); with prose_only,
    each cut before its first NumPy-style section of parameters, examples or references."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]
    docs = [ast.get_docstring(n) for n in nodes]
    # numpy's _add_newdocs passes its documentation as string arguments: take long string constants there too
    docs += [n.value for n in ast.walk(tree) if prose_only and isinstance(n, ast.Constant) and isinstance(n.value, str) and len(n.value) > 400]
    out = []
    for doc in dict.fromkeys(d for d in docs if d):
        if prose_only:
            doc = CODE_SECTIONS.split("\n" + doc, maxsplit=1)[0]
        doc = doc.strip()
        if len(doc) > 200 and not doc.startswith(">>>"):
            out.append(doc)
    return out


def _sources(root: Path | None, names) -> list[Path]:
    return [] if root is None else [p for p in (root / f"{name}.py" for name in names) if p.is_file()]


def library() -> list[str]:
    """Docstrings of the standard library modules in LIBRARY."""
    return [doc for path in _sources(Path(sysconfig.get_paths()["stdlib"]), LIBRARY) for doc in _docstrings(path, False)]


def science() -> list[str]:
    """The prose of NumPy's docstrings in SCIENCE (up to their first section of parameters, returns or examples)."""
    spec = importlib.util.find_spec("numpy")
    root = Path(spec.origin).parent.parent if spec and spec.origin else None
    return [doc for path in _sources(root, SCIENCE) for doc in _docstrings(path, True)]


def _distributions():
    for name in DEPENDENCIES:
        try:
            yield importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue


def legal() -> list[str]:
    """Distinct paragraphs of Python's LICENSE.txt and of the license files the dependencies ship."""
    paths = [Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"]
    for dist in _distributions():
        paths += [Path(dist.locate_file(f)) for f in dist.files or () if re.search(r"(licen[cs]e|copying|notice)[^/]*$", str(f), re.I)]
    paragraphs: dict[str, None] = {}
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for paragraph in re.split(r"\n\s*\n", text):
            paragraph = paragraph.strip()
            if len(paragraph) > 80 and sum(c.isalpha() for c in paragraph) > 0.6 * len(paragraph):
                paragraphs.setdefault(paragraph)
    return list(paragraphs)


def readme() -> list[str]:
    """The dependencies' project descriptions (README text in their installed metadata)."""
    docs = []
    for dist in _distributions():
        text = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if len(text) > 200:
            docs.append(text.strip())
    return docs


KINDS = {"reference": reference, "library": library, "science": science, "legal": legal, "readme": readme}


def pieces(documents: list[str], size: int = PIECE, share: int = SHARE) -> list[str]:
    """Documents cut at paragraph boundaries into pieces of about `size` characters, at most `share` in all."""
    out, current, total = [], "", 0
    paragraphs = (p for document in documents for p in re.split(r"\n\s*\n", document) if p.strip())
    for paragraph in paragraphs:
        current = f"{current}\n\n{paragraph}" if current else paragraph
        if len(current) >= size:
            out.append(current)
            total, current = total + len(current), ""
            if total >= share:
                return out
    return out + [current] if current else out


@functools.lru_cache(maxsize=1)
def mixed() -> tuple[str, ...]:
    """The built-in corpus: pieces of every kind in KINDS, each kind's spread evenly over the whole (module docstring)."""
    kinds = [pieces(read()) for read in KINDS.values()]
    placed = [((i + 0.5) / len(kind), k, piece) for k, kind in enumerate(kinds) for i, piece in enumerate(kind)]
    return tuple(piece for _, _, piece in sorted(placed, key=lambda p: p[:2]))


def samples(model, rows: int, seq_len: int, prefix: list[int], seed: int) -> np.ndarray:
    """`rows` windows of seq_len ids the model writes itself: `prefix` (BOS), then tokens sampled at temperature 1,
    one step at a time with its KV cache (the whole window again each step for a graph without one, or whose cached
    step ONNX Runtime cannot run here, as the GenAI builder's fp16 graphs on the CPU). Row r draws
    from numpy's generator seeded (seed, r): a row's tokens do not depend on how many rows are asked for."""
    from surgery.measure import runtime

    ids = np.tile(np.asarray(prefix or [0], np.int64), (rows, 1))
    if rows == 0:
        return np.zeros((0, seq_len), np.int64)
    rngs = [np.random.default_rng([seed, r]) for r in range(rows)]
    sess = runtime.session(model)
    runtime.vocab_size(sess)  # a graph without logits: one line
    names = [o.name for o in sess.get_outputs()]
    cached, past = runtime.has_kv_cache(sess), None
    quiet = runtime.ort.RunOptions()
    quiet.log_severity_level = 4  # a failing cached step is handled below, not logged
    while ids.shape[1] < seq_len:
        try:
            step = ids[:, -1:] if cached and past is not None else ids
            outputs = sess.run(None, runtime.feeds(sess, step, past if cached else None), quiet)
        except runtime.ort.capi.onnxruntime_pybind11_state.Fail:  # a cached step ORT cannot run here (GenAI fp16 on CPU)
            if not (cached and past is not None):
                raise
            cached, past = False, None
            outputs = sess.run(None, runtime.feeds(sess, ids))
        logits = np.asarray(outputs[names.index("logits")][:, -1, :], np.float64)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        cdf = np.cumsum(p / p.sum(axis=1, keepdims=True), axis=1)
        draws = np.array([rng.random() for rng in rngs])[:, None]
        ids = np.concatenate([ids, np.minimum((cdf < draws).sum(axis=1, keepdims=True), p.shape[1] - 1)], axis=1)
        past = runtime.present_as_past(sess, outputs) if cached else None
    return ids
