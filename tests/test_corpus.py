"""The built-in corpus: several kinds of English text, each spread over the whole, so every part of the windows holds every kind."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from graphs import make_corpus
from surgery.text import corpus, data

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("reference", "library", "science", "legal", "readme")


def test_the_built_in_text_is_the_pinned_file_read_without_site_packages():
    """The default corpus's text is the packaged file's, whatever is installed: read by a Python that sees no
    site-packages (no NumPy, no dependency), it has the pinned digest."""
    assert corpus.text_digest(corpus.mixed()) == corpus.DIGEST
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from surgery.text import corpus; "
            "print(corpus.text_digest(corpus.mixed()), len(corpus.mixed()), 'numpy' in sys.modules, any('site-packages' in p for p in sys.path))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(ROOT)], capture_output=True, text=True, check=True).stdout.split()
    assert out == [corpus.DIGEST, str(len(corpus.mixed())), "False", "False"]


def test_every_kind_has_its_share():
    sizes = {name: sum(len(p) for p, k in zip(corpus.mixed(), corpus.kinds()) if k == name) for name in KINDS}
    assert sizes == corpus.provenance()["kinds"]
    for name, size in sizes.items():
        assert 50_000 < size < make_corpus.SHARE + 3 * make_corpus.PIECE, (name, size)  # every kind contributes, none outweighs the rest


def test_pieces_keep_paragraphs_whole_and_stop_at_the_share():
    paragraphs = [f"paragraph {i} " + "word " * (i % 7 + 3) for i in range(400)]
    cut = make_corpus.pieces(["\n\n".join(paragraphs[:150]), "\n\n".join(paragraphs[150:])], size=120, share=5000)
    assert all(len(p) >= 120 for p in cut[:-1])
    assert 5000 <= sum(map(len, cut)) < 5000 + 120 + 50
    rejoined = [p for piece in cut for p in piece.split("\n\n")]
    assert rejoined == paragraphs[: len(rejoined)]  # in order, none split or dropped before the share
    everything = make_corpus.pieces(["\n\n".join(paragraphs)], size=120, share=10**9)
    assert [p for piece in everything for p in piece.split("\n\n")] == paragraphs  # the tail piece is kept


def test_each_kind_is_spread_over_the_whole_corpus():
    kinds = np.asarray(corpus.kinds())
    assert set(kinds) == set(KINDS)
    for name in KINDS:
        where = np.flatnonzero(kinds == name)
        gap = len(kinds) / len(where)  # the even spacing
        assert where[0] <= gap and where[-1] >= len(kinds) - 1 - gap, name
        assert np.diff(where).max() <= 2 * gap + 1, name


def test_fit_selection_and_evaluation_windows_each_hold_every_kind(fixture_path):
    """The windows the main job takes from the default corpus: each part reads text of every kind, and samples."""
    deck = corpus.mixed()
    owner = dict(zip(deck, corpus.kinds()))
    text = "\n\n".join(deck)
    ends = np.cumsum([len(p) + 2 for p in deck])  # character offset where each piece ends
    tok = data.load_tokenizer(fixture_path("llama"))
    offsets = np.asarray([start for start, _ in tok.encode(text, add_special_tokens=False).offsets])
    kind_of_token = np.asarray([owner[deck[i]] for i in np.searchsorted(ends, offsets, side="right")])
    cal = data.windows(fixture_path("llama"), seq_len=256, max_windows=80, part="calibration")
    fit, selection = data.deal(cal, [64, 16], ["fit", "selection"])
    evaluation = data.windows(fixture_path("llama"), seq_len=256, max_windows=32, part="evaluation")
    for part in (fit, selection, evaluation):
        seen = {k for s in part.starts if s >= 0 for k in kind_of_token[s : s + 255]}
        assert seen == set(KINDS), (part.name, seen)
        assert part.describe()["corpus_digest"] == corpus.DIGEST
        assert (part.starts < 0).sum() == len(part) // 2, part.name  # the model's own samples: half of every part


def test_pydoc_is_the_language_reference_alone_and_the_default_text_is_the_mix():
    texts, name = data.read_texts("pydoc")
    assert name == "pydoc_data.topics" and "\n\n".join(texts) == data.default_corpus()
    texts, name = data.read_texts(None)
    assert name == "built-in text" and tuple(texts) == corpus.mixed() and data.read_texts("text") == (texts, name)
    assert re.search(r"\blicen[cs]e\b", "\n".join(texts), re.I) and "ndarray" in "\n".join(texts)


def test_a_file_corpus_is_named_by_the_digest_of_its_text(fixture_path, tmp_path):
    text = "\n\n".join(data.default_corpus().split("\n\n")[:400])
    (tmp_path / "c.txt").write_text(text)
    windows = data.windows(fixture_path("llama"), tmp_path / "c.txt", seq_len=32, max_windows=2)
    assert windows.describe()["corpus_digest"] == corpus.text_digest([text]) != corpus.DIGEST
