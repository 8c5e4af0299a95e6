"""Make the built-in corpus's pinned file, surgery/text/corpus-v1.jsonl.xz: five kinds of English text that Python
and surgery's dependencies ship, read once from an environment and frozen, so that the default corpus is the same bytes
on every machine and every install (docs/corpus.md names the sources and their licences).

    python graphs/make_corpus.py [--check]    # in an environment with surgery[export,test,genai,ray] installed

The file was made with CPython 3.11.7 and the versions its first line records. Run it again only to make a new
version of the corpus (a new file name and surgery.text.corpus.DIGEST): results on the default corpus move with it.
--check rebuilds the pieces here and says whether they equal the pinned file's (they do only with the same versions).

    reference   the Python language reference (`pydoc_data.topics`)
    library     the standard library's own documentation (module, class and function docstrings of LIBRARY's modules)
    science     NumPy's documentation of its numerical, statistical and linear-algebra routines (prose sections)
    legal       the licenses Python and the dependencies ship (distinct paragraphs)
    readme      the dependencies' project descriptions (their README, from the installed metadata)

Each kind is cut at paragraph boundaries into pieces of about PIECE characters, at most SHARE characters of it are used
(so that no kind outweighs the others), and each kind's pieces are spread evenly over the corpus, so that every segment
of the token stream, and with it the fit, selection and evaluation parts, holds every kind (data.py deals segments of
8 windows; a piece is about two windows). Sources are read from files (ast for docstrings); nothing is imported but
pydoc_data.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import lzma
import platform
import re
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from surgery.text import corpus  # noqa: E402  (after the repository is on sys.path)

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


KINDS = {"reference": corpus.reference, "library": library, "science": science, "legal": legal, "readme": readme}


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


def mixed() -> list[tuple[str, str]]:
    """(kind, piece) of every kind in KINDS, read here, each kind's pieces spread evenly over the whole."""
    kinds = [(name, pieces(read())) for name, read in KINDS.items()]
    placed = [((i + 0.5) / len(cut), k, name, piece) for k, (name, cut) in enumerate(kinds) for i, piece in enumerate(cut)]
    return [(name, piece) for _, _, name, piece in sorted(placed, key=lambda p: p[:2])]


def versions() -> dict[str, str]:
    """What the pieces were read from: Python, and each dependency's version (None: not installed)."""
    found = {"python": platform.python_version()}
    for name in DEPENDENCIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare the pieces read here with the pinned file's; write nothing")
    args = parser.parse_args()
    pieces_here = mixed()
    if args.check:
        same = [p for _, p in pieces_here] == list(corpus.mixed())
        print(f"{'equal to' if same else 'differs from'} the pinned corpus {corpus.FILE.name} ({len(pieces_here)} pieces here)")
        sys.exit(0 if same else 1)
    head = {"corpus": "built-in text", "version": 1, "read from": versions(),
            "kinds": {name: sum(len(p) for k, p in pieces_here if k == name) for name in KINDS}}
    lines = [json.dumps(head)] + [json.dumps({"kind": k, "text": p}) for k, p in pieces_here]
    corpus.FILE.write_bytes(lzma.compress(("\n".join(lines) + "\n").encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
    print(f"wrote {corpus.FILE} ({corpus.FILE.stat().st_size} bytes, {len(pieces_here)} pieces); "
          f"its digest, for surgery.text.corpus.DIGEST: {corpus.text_digest([p for _, p in pieces_here])}")


if __name__ == "__main__":
    main()
