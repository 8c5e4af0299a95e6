"""The built-in calibration corpus: several kinds of English text, pinned in a file shipped with surgery, and text the
model writes itself.

A fix fitted on one kind of text holds its budget on that kind, not beyond it; methods that calibrate on data
(GPTQ, SLEB, ReplaceMe) calibrate on broad text for this reason. Without a network the broadest text a machine
surely has is the model's own: `samples` draws windows from it at temperature 1 from BOS, text from the
distribution it was trained on (self-calibration, Williams et al. 2025, found such samples calibrate quantization
and pruning as well as real text). Beside them the default corpus mixes five kinds of text Python and surgery's
dependencies ship (the Python reference, the standard library's docstrings, NumPy's documentation, licences, the
dependencies' READMEs), read once by graphs/make_corpus.py and pinned in FILE: the same bytes on every machine and
every install, whatever is installed beside surgery (docs/corpus.md names the sources and their licences). DIGEST is
the sha256 of its text as tokenized (`text_digest`); selection.json and report.json record the digest of the corpus a
run read. data.windows puts text and samples together: a share SAMPLED of every part's windows are samples.

This module imports nothing outside the standard library until `samples` runs, so the pinned text can be read (and
its digest checked) without site-packages.
"""

from __future__ import annotations

import functools
import hashlib
import json
import lzma
import typing
from pathlib import Path

if typing.TYPE_CHECKING:  # NumPy is imported where samples are drawn: the pinned text reads without site-packages
    import numpy as np

SAMPLED = 0.5  # the share of the default corpus's windows that are the model's own samples
FILE = Path(__file__).with_name("corpus-v1.jsonl.xz")  # graphs/make_corpus.py wrote it: a line of provenance, then (kind, text) per piece
RULES = ("gumbel", "inverse")  # how `draw` samples a token (gumbel: float noise rarely moves a draw; benchmarks/samples.py)
RULE = "gumbel"
DIGEST = "7d3020a421f8872828a485cf8a85d177f0039655d46fa10e20bc155d8b765470"  # text_digest(mixed()): tests/test_corpus.py holds the file to it


def reference() -> list[str]:
    """The Python language reference of the Python running: `pydoc_data.topics`, in sorted key order (`--data pydoc`)."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def text_digest(documents) -> str:
    """The sha256 of a corpus's text as it is tokenized (documents joined by a blank line)."""
    return hashlib.sha256("\n\n".join(documents).encode("utf-8")).hexdigest()


@functools.lru_cache(maxsize=1)
def _pinned() -> tuple[dict, tuple[tuple[str, str], ...]]:
    lines = lzma.decompress(FILE.read_bytes()).decode("utf-8").splitlines()
    records = [json.loads(line) for line in lines[1:]]
    return json.loads(lines[0]), tuple((r["kind"], r["text"]) for r in records)


def provenance() -> dict:
    """The pinned file's first line: its name and version, what it was read from, and the characters of each kind."""
    return _pinned()[0]


def mixed() -> tuple[str, ...]:
    """The built-in text: the pinned pieces, every kind's spread evenly over the whole."""
    return tuple(text for _, text in _pinned()[1])


def kinds() -> tuple[str, ...]:
    """The kind of each piece of `mixed()`."""
    return tuple(kind for kind, _ in _pinned()[1])


def samples(model, rows: int, seq_len: int, prefix: list[int], seed: int, options=None, rule: str = RULE, first: int = 0,
            progress=None) -> np.ndarray:
    """`rows` windows of seq_len ids the model writes itself: `prefix` (BOS), then tokens sampled at temperature 1 (`draw`),
    one step at a time with its KV cache (the whole window again each step for a graph without one, or whose cached
    step ONNX Runtime cannot run here, as the GenAI builder's fp16 graphs on the CPU). Row r draws from numpy's generator
    seeded (seed, r), r from `first`: a row's tokens do not depend on how many rows are asked for. options: the
    session's (runtime.Options; its defaults when None); rule: `draw`'s; progress: called as progress(tokens drawn, all)
    after each step of all the rows."""
    import numpy as np

    from surgery.engine import runtime

    ids = np.tile(np.asarray(prefix or [0], np.int64), (rows, 1))
    if rows == 0:
        return np.zeros((0, seq_len), np.int64)
    rngs = [np.random.default_rng([seed, r]) for r in range(first, first + rows)]
    sess = runtime.session(model, options or runtime.Options())
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
        ids = np.concatenate([ids, draw(outputs[names.index("logits")][:, -1, :], rngs, rule)[:, None]], axis=1)
        past = runtime.present_as_past(sess, outputs) if cached else None
        if progress:
            progress(ids.shape[1] - len(prefix or [0]), seq_len - len(prefix or [0]))
    return ids


def draw(logits, rngs, rule: str = RULE):
    """One token per row of `logits` [rows, vocab], sampled at temperature 1 with that row's generator in `rngs`.

    `gumbel`: the token with the largest logit + g, g drawn from the standard Gumbel distribution for every token
    (the Gumbel-max trick: exactly softmax sampling). Float noise in the logits (another thread count, kernel or CPU)
    changes the draw only where the two largest sums lie within the noise of each other. `inverse`: the first token
    whose cumulative probability exceeds one uniform number (the rule before 2026-12-06): noise in every one of the
    vocabulary's cumulative sums can move it. benchmarks/samples.py measures both."""
    import numpy as np

    z = np.asarray(logits, np.float64)
    if rule == "gumbel":
        return np.argmax(z + np.stack([rng.gumbel(size=z.shape[1]) for rng in rngs]), axis=1).astype(np.int64)
    if rule != "inverse":
        raise ValueError(f"unknown sampling rule {rule!r}; use one of {', '.join(RULES)}")
    p = np.exp(z - z.max(axis=1, keepdims=True))
    cdf = np.cumsum(p / p.sum(axis=1, keepdims=True), axis=1)
    u = np.array([rng.random() for rng in rngs])
    return np.minimum((cdf < u[:, None]).sum(axis=1), p.shape[1] - 1).astype(np.int64)
