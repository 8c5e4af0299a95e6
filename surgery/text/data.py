"""Corpora -> token windows: a built-in corpus (corpus.py), a text file, or a jsonl file with a `text` field.

The corpus is tokenized once (documents joined by a blank line) into one token stream, cut into
segments of SEGMENT_WINDOWS windows' worth of tokens. Segments are dealt to two disjoint parts,
interleaved so both see the whole corpus: calibration (a `calibration` fraction of the segments:
defect scores, alpha_l, layer selection) and evaluation (the rest: reported loss). Windows of
seq_len tokens are cut inside each segment; when the tokenizer's own post-processor prepends BOS,
every window starts with it. With stride < seq_len, windows overlap and only the last `stride`
targets of a window (all of the segment's first window's) are scored, so every token is scored
once. `max_windows` takes windows evenly spaced over the part, not its first ones.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import typing
from pathlib import Path

import numpy as np

from surgery.engine.progress import Count, Tell, silent
from surgery.errors import SurgeryError
from surgery.files import graph
from surgery.text import corpus

if typing.TYPE_CHECKING:  # imported where a tokenizer is read: the graph passes run without tokenizers (the GPU machine has none)
    from tokenizers import Tokenizer

    from surgery.model.subject import Subject

BUILT_IN = {  # the names --data takes for the embedded corpora -> (documents, display name)
    "text": (lambda: list(corpus.mixed()), "built-in text"),  # the default's text: several kinds (corpus.py)
    "pydoc": (corpus.reference, "pydoc_data.topics"),  # the default before the mix: the language reference alone
}
SEEDS = {"calibration": 1, "evaluation": 2}  # of the model's samples in each part (corpus.samples)
SEGMENT_WINDOWS = 8
PARTS = ("evaluation", "calibration", "all")


@dataclasses.dataclass(frozen=True)
class Windows:
    """Token windows to score. Target t of window w is ids[w, t + 1], predicted at position t.

    Made by `windows()`; `len(w)` is the number of windows, `w.take(indices)` a selection of them.

    Attributes:
        ids: [n_windows, seq_len] int64 token ids (each window starts with BOS when the tokenizer prepends one).
        score_from: [n_windows]: the first target index that counts in each window (earlier ones were scored by the
            window before, when windows overlap).
        starts: [n_windows]: the offset of each window's first non-BOS token in the corpus token stream.
        name: the corpus and part, e.g. `pydoc_data.topics (evaluation part)`.
        digest: the sha256 of the corpus's text as tokenized (corpus.text_digest; the built-in text's is corpus.DIGEST).
    """

    ids: np.ndarray  # [n_windows, seq_len] int64
    score_from: np.ndarray  # [n_windows]: first target index that counts (earlier ones were scored before)
    starts: np.ndarray  # [n_windows]: offset of each window's first non-BOS token in the corpus token stream
    name: str
    digest: str = ""

    @property
    def seq_len(self) -> int:
        """Tokens per window."""
        return int(self.ids.shape[1])

    @property
    def sampled(self) -> np.ndarray:
        """[n_windows] bool: the windows that are the model's own samples (the default corpus's; negative starts)."""
        return self.starts < 0

    @property
    def tokens(self) -> int:
        """Number of scored targets (tokens) over all the windows."""
        return int(sum(self.seq_len - 1 - int(s) for s in self.score_from))

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def describe(self) -> dict:
        """What a report says of these windows (report.schema.json's window_set)."""
        return {"corpus": self.name, "count": len(self), "seq_len": self.seq_len, "tokens": self.tokens, "sampled": int(self.sampled.sum()),
                **({"corpus_digest": self.digest} if self.digest else {}),
                "ids_digest": hashlib.sha256(np.ascontiguousarray(self.ids, np.int64).tobytes()).hexdigest()}

    def take(self, indices, name: str | None = None) -> "Windows":
        """The windows at `indices` (in that order), named `name` (default: this one's name)."""
        indices = np.asarray(indices, dtype=np.int64)
        return Windows(self.ids[indices], self.score_from[indices], self.starts[indices], name or self.name, self.digest)


def spread(n: int, count: int | None) -> np.ndarray:
    """`count` of the indices 0..n-1, evenly spaced and in order (all of them when None or count >= n)."""
    if count is None or count >= n:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, count).round().astype(np.int64))


def deal(windows: Windows, sizes: list[int], names: list[str]) -> list[Windows]:
    """Split `windows` into disjoint parts of the given sizes, dealt in turn (so each part spans the
    corpus as the windows do). Needs len(windows) >= sum(sizes); any rest is left out."""
    total = sum(sizes)
    if len(windows) < total:
        raise SurgeryError(
            f"{windows.name} has {len(windows)} windows, fewer than the {total} asked for ({' + '.join(map(str, sizes))}); "
            "use a bigger corpus or fewer windows"
        )
    owners: list[list[int]] = [[] for _ in sizes]
    for i in range(total):  # the part furthest behind its share takes the next window
        k = max(range(len(sizes)), key=lambda j: sizes[j] * (i + 1) / total - len(owners[j]))
        owners[k].append(i)
    return [windows.take(idx, f"{windows.name}, {name}") for idx, name in zip(owners, names)]


def default_corpus() -> str:
    """The English text of `pydoc_data.topics` (shipped with every CPython), joined in sorted key order."""
    return "\n\n".join(corpus.reference())


def read_texts(data: str | Path | None) -> tuple[list[str], str]:
    """Documents of a corpus and its display name: None is the default's text, `text` / `pydoc` a built-in corpus
    (BUILT_IN), else a .txt or .jsonl file."""
    read, name = BUILT_IN.get("text" if data is None else str(data), (None, None))
    if read is not None:
        return read(), name
    path = Path(data)
    if not path.is_file():
        raise SurgeryError(f"data file {path} does not exist; pass a .txt or .jsonl file, or leave --data out for the default corpus")
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as e:
        raise SurgeryError(f"cannot read {path} as UTF-8 text ({type(e).__name__}); pass a .txt or .jsonl file") from None
    if path.suffix.lower() != ".jsonl":
        return [text], path.name
    texts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise SurgeryError(f"{path} line {number} is not JSON; each line of a .jsonl file must be an object with a `text` field") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise SurgeryError(f"{path} line {number} has no string `text` field; each line needs one")
        texts.append(record["text"])
    return texts, path.name


def load_tokenizer(model: str | Path, tokenizer: str | Path | None = None) -> Tokenizer:
    """The tokenizer.json given, or the one in the model's folder (beside a bare .onnx file)."""
    if tokenizer is not None:
        path = Path(tokenizer)
        path = path / "tokenizer.json" if path.is_dir() else path
    else:
        path = graph.resolve(model).parent / "tokenizer.json"
    if not path.is_file():
        raise SurgeryError(
            f"found no tokenizer at {path}; pass a folder from `surgery export` or --tokenizer PATH/tokenizer.json"
        )
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise SurgeryError(f"cannot read tokenizer {path} ({str(e).splitlines()[0]}); re-export the model") from None


def bos_prefix(tokenizer: Tokenizer) -> list[int]:
    """Ids the tokenizer's post-processor puts before a single sequence (BOS for Llama-style tokenizers)."""
    plain = tokenizer.encode("surgery", add_special_tokens=False).ids
    full = tokenizer.encode("surgery").ids
    if plain and full[-len(plain) :] == plain:
        return full[: len(full) - len(plain)]
    return []


def token_stream(texts: list[str], tokenizer: Tokenizer) -> np.ndarray:
    """All documents as one stream of ids, without special tokens."""
    encodings = tokenizer.encode_batch(["\n\n".join(texts)], add_special_tokens=False)
    return np.asarray(encodings[0].ids, dtype=np.int64)


@functools.lru_cache(maxsize=4)
def _stream(tokenizer_json: str, texts: tuple[str, ...]) -> np.ndarray:
    """token_stream, remembered: one command asks for several parts of the same corpus."""
    from tokenizers import Tokenizer

    stream = token_stream(list(texts), Tokenizer.from_str(tokenizer_json))
    stream.flags.writeable = False
    return stream


def make_windows(
    stream: np.ndarray, seq_len: int, stride: int | None, prefix: list[int], name: str, offset: int = 0
) -> Windows:
    """Cut a token stream into windows of seq_len ids: prefix + body; consecutive bodies start `stride` apart."""
    body = seq_len - len(prefix)
    stride = body if stride is None else stride
    if body < 2:
        raise SurgeryError(f"--seq-len {seq_len} leaves no room to predict a token; use at least {len(prefix) + 2}")
    if not 0 < stride <= body:
        raise SurgeryError(f"--stride {stride} must be between 1 and --seq-len ({body} without BOS)")
    starts = list(range(0, max(len(stream) - body, -1) + 1, stride))
    if len(stream) < body or not starts:
        raise SurgeryError(
            f"{name} has {len(stream)} tokens, fewer than one window of --seq-len {seq_len}; "
            "use a bigger corpus or a smaller --seq-len"
        )
    ids = np.stack([np.concatenate([np.asarray(prefix, np.int64), stream[s : s + body]]) for s in starts])
    # Targets before `score_from` were scored by the previous window; the first window scores all.
    # Target t predicts ids[t + 1]; body token j sits at position len(prefix) + j.
    score_from = np.array([0] + [len(prefix) + body - stride - 1 for _ in starts[1:]], dtype=np.int64)
    score_from = np.maximum(score_from, 0)
    return Windows(ids, score_from, np.asarray(starts, dtype=np.int64) + offset, name)


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """Where windows come from, for every command that reads a corpus: `--data`, `--seq-len`, `--tokenizer`, `--stride`.

    Attributes:
        data: the corpus (see `windows`): a .txt or .jsonl file, `text`, `pydoc`, or None: the default.
        seq_len: tokens per window, BOS included when the tokenizer prepends one.
        tokenizer: a tokenizer.json, or a folder holding one, to use instead of the model folder's.
        stride: tokens between the starts of consecutive windows (None: seq_len without BOS, no overlap).
    """

    data: str | Path | None = None
    seq_len: int = 256
    tokenizer: str | Path | None = None
    stride: int | None = None

    def windows(self, model: "str | Path | Subject", count: int | None, part: str, progress: Tell | None = None) -> "Windows":
        """`count` windows (None: all) of the corpus's `part` for `model` (`windows`)."""
        return windows(model, self.data, seq_len=self.seq_len, stride=self.stride, max_windows=count, part=part, tokenizer=self.tokenizer,
                       progress=progress)


def windows(
    model: "str | Path | Subject",
    data: str | Path | None = None,
    *,
    seq_len: int = 256,
    stride: int | None = None,
    max_windows: int | None = None,
    part: str = "evaluation",
    calibration: float = 0.25,
    tokenizer: str | Path | None = None,
    progress: Tell | None = None,
) -> Windows:
    """Token windows of a corpus for `model`: the `part` (evaluation, calibration or all) of its token stream.

    The corpus is tokenized once (documents joined by a blank line) with the model's tokenizer and cut into segments of
    8 windows' worth of tokens, dealt to the calibration and evaluation parts so both span the corpus (module docstring).

    Args:
        model: the exported model (an .onnx file, or a folder holding one): its folder holds the tokenizer.json; or the Subject a
            command loaded from that path, whose model draws the samples (the file is not read again).
        data: the corpus: a .txt file, a .jsonl file with a `text` field per line, `text`: the built-in mix of several
            kinds of English text, `pydoc`: the Python language reference alone, or None: the default, where a share
            corpus.SAMPLED of each part's max_windows are the model's own samples (corpus.samples) and the rest `text`
            (without max_windows: every window of `text`, no samples).
        seq_len: tokens per window, BOS included when the tokenizer prepends one.
        stride: tokens between the starts of consecutive windows of a segment (None: seq_len without BOS, no overlap);
            with a smaller stride windows overlap and each token is scored once.
        max_windows: at most this many windows, evenly spaced over the part (None: all of them).
        part: `evaluation` (the reported loss), `calibration` (fits, scores, selection) or `all` (both, in corpus order).
        calibration: the fraction of the segments that goes to the calibration part, between 0 and 1.
        tokenizer: a tokenizer.json, or a folder holding one, to use instead of the model folder's.
        progress: called as progress(stage, done, total) while the model's samples are drawn (their tokens).

    Returns:
        The Windows: ids [n_windows, seq_len], the first scored target of each window, and their offsets in the stream
        (negative for the model's samples).

    Raises:
        SurgeryError: an unknown part, max_windows below 1, a calibration fraction outside (0, 1), no tokenizer, a corpus
            file that is missing or not UTF-8 text (or a .jsonl line without a string `text`), a seq_len or stride that
            leaves no room, or a corpus too short for one window of the part.
    """
    if part not in PARTS:
        raise SurgeryError(f"unknown part {part!r}; use one of {', '.join(PARTS)}")
    if max_windows is not None and max_windows < 1:
        raise SurgeryError(f"{max_windows} windows asked for; ask for at least 1")
    if not 0 < calibration < 1:
        raise SurgeryError(f"calibration fraction {calibration} must be between 0 and 1")
    path = model if isinstance(model, (str, Path)) else model.where  # a Subject: loaded from its path
    tok = load_tokenizer(path, tokenizer)
    texts, name = read_texts(data)
    stream = _stream(tok.to_str(), tuple(texts))
    if len(stream) == 0:
        raise SurgeryError(f"{name} has no text; pass a corpus with some")
    prefix = bos_prefix(tok)
    parts = _segments(stream, seq_len, stride, prefix, name, calibration)
    chosen = parts["calibration"] + parts["evaluation"] if part == "all" else parts[part]
    if not chosen:
        make_windows(stream, seq_len, stride, prefix, name)  # raises the "fewer than one window" error
        raise SurgeryError(f"{name} is too short for a {part} part at --seq-len {seq_len}; use a bigger corpus or a smaller --seq-len")
    if part == "all":
        chosen.sort(key=lambda w: int(w.starts[0]))
    result = Windows(
        np.concatenate([w.ids for w in chosen]),
        np.concatenate([w.score_from for w in chosen]),
        np.concatenate([w.starts for w in chosen]),
        f"{name} ({part} part)",
        corpus.text_digest(texts),
    )
    sampled = corpus.SAMPLED if data is None and max_windows is not None else 0.0  # all windows: every text one, no samples
    count = len(result) if max_windows is None else max_windows
    text_count = min(count - round(count * sampled), len(result))
    if text_count < len(result):
        result = result.take(spread(len(result), text_count))
    if sampled:
        result = _with_samples(model, result, count - text_count, part, calibration, prefix, progress)
    return result


def _segments(stream: np.ndarray, seq_len: int, stride: int | None, prefix: list[int], name: str, calibration: float) -> dict[str, list[Windows]]:
    """The stream cut into segments of SEGMENT_WINDOWS windows' worth of tokens, each segment's windows dealt to the
    calibration part (a share `calibration` of the segments, spread evenly) or the evaluation part."""
    body = seq_len - len(prefix)
    size = SEGMENT_WINDOWS * max(body, 1)
    parts: dict[str, list[Windows]] = {"calibration": [], "evaluation": []}
    for j, lo in enumerate(range(0, len(stream), size)):
        segment = stream[lo : lo + size]
        if len(segment) < body:
            continue
        owner = "calibration" if int((j + 1) * calibration) > int(j * calibration) else "evaluation"
        parts[owner].append(make_windows(segment, seq_len, stride, prefix, name, offset=lo))
    return parts


_SAMPLED: dict[tuple, np.ndarray] = {}  # corpus.samples, remembered (a command asks for the same part more than once)


def _samples(model, rows: int, seq_len: int, prefix: tuple[int, ...], seed: int, progress: Count | None) -> np.ndarray:
    """corpus.samples of the model at a path, or of a Subject's model (loaded from its path); remembered by the file's path
    and mtime."""
    path = graph.resolve(model if isinstance(model, (str, Path)) else model.where)
    key = (str(path), path.stat().st_mtime_ns, rows, seq_len, prefix, seed)
    if key not in _SAMPLED:
        while len(_SAMPLED) >= 8:
            _SAMPLED.pop(next(iter(_SAMPLED)))
        source = model if isinstance(model, (str, Path)) else model.model
        _SAMPLED[key] = ids = corpus.samples(source, rows, seq_len, list(prefix), seed, progress=progress)
        ids.flags.writeable = False
    return _SAMPLED[key]


def _with_samples(model, text: Windows, rows: int, part: str, calibration: float, prefix: list[int], progress: Tell | None) -> Windows:
    """The text windows and `rows` windows of the model's own samples (SEEDS[part]; `all`: both parts' in their
    proportion), each kind spread evenly over the result. Samples score every target; their starts are negative
    (-1 - row), as they sit in no corpus stream."""
    counts = {"calibration": round(rows * calibration), "evaluation": rows - round(rows * calibration)} if part == "all" else {part: rows}
    tell = progress or silent
    ids = [_samples(model, n, text.seq_len, tuple(prefix), SEEDS[p], lambda d, t, p=p, n=n: tell(f"the model's samples ({n} {p} windows)", d, t))
           for p, n in counts.items() if n]
    ids = np.concatenate(ids) if ids else np.zeros((0, text.seq_len), np.int64)
    spots = sorted([((i + 0.5) / len(text), 0, i) for i in range(len(text))] + [((i + 0.5) / len(ids), 1, i) for i in range(len(ids))])
    take = lambda mine, theirs: np.stack([theirs[i] if k else mine[i] for _, k, i in spots])  # noqa: E731
    return Windows(
        take(text.ids, ids),
        take(text.score_from, np.zeros(len(ids), np.int64)),
        take(text.starts, -1 - np.arange(len(ids), dtype=np.int64)),
        text.name.replace(" (", " + the model's samples (", 1),
        text.digest,
    )
