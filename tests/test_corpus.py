"""The built-in corpus: several kinds of English text, each spread over the whole, so every part of the windows holds every kind."""

import re

import numpy as np

from surgery.measure import corpus, data


def test_every_kind_is_on_this_machine_and_has_its_share():
    for name, read in corpus.KINDS.items():
        cut = corpus.pieces(read())
        size = sum(map(len, cut))
        assert size > 50_000, f"{name}: {size} characters"  # every kind contributes, none is a token presence
        assert size < corpus.SHARE + 3 * corpus.PIECE + max(map(len, cut)), name  # and none outweighs the rest


def test_pieces_keep_paragraphs_whole_and_stop_at_the_share():
    paragraphs = [f"paragraph {i} " + "word " * (i % 7 + 3) for i in range(400)]
    cut = corpus.pieces(["\n\n".join(paragraphs[:150]), "\n\n".join(paragraphs[150:])], size=120, share=5000)
    assert all(len(p) >= 120 for p in cut[:-1])
    assert 5000 <= sum(map(len, cut)) < 5000 + 120 + 50
    rejoined = [p for piece in cut for p in piece.split("\n\n")]
    assert rejoined == paragraphs[: len(rejoined)]  # in order, none split or dropped before the share
    everything = corpus.pieces(["\n\n".join(paragraphs)], size=120, share=10**9)
    assert [p for piece in everything for p in piece.split("\n\n")] == paragraphs  # the tail piece is kept


def test_each_kind_is_spread_over_the_whole_corpus():
    deck = corpus.mixed()
    owner = {piece: name for name, read in corpus.KINDS.items() for piece in corpus.pieces(read())}
    kinds = [owner[piece] for piece in deck]
    assert set(kinds) == set(corpus.KINDS)
    for name in corpus.KINDS:
        where = np.flatnonzero(np.asarray(kinds) == name)
        gap = len(deck) / len(where)  # the even spacing
        assert where[0] <= gap and where[-1] >= len(deck) - 1 - gap, name
        assert np.diff(where).max() <= 2 * gap + 1, name


def test_fit_selection_and_evaluation_windows_each_hold_every_kind(fixture_path):
    """The windows the main job takes from the default corpus: each part reads text of every kind, and samples."""
    deck = corpus.mixed()
    owner = {piece: name for name, read in corpus.KINDS.items() for piece in corpus.pieces(read())}
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
        assert seen == set(corpus.KINDS), (part.name, seen)
        assert (part.starts < 0).sum() == len(part) // 2, part.name  # the model's own samples: half of every part


def test_pydoc_is_the_language_reference_alone_and_the_default_text_is_the_mix():
    texts, name = data.read_texts("pydoc")
    assert name == "pydoc_data.topics" and "\n\n".join(texts) == data.default_corpus()
    texts, name = data.read_texts(None)
    assert name == "built-in text" and tuple(texts) == corpus.mixed() and data.read_texts("text") == (texts, name)
    assert re.search(r"\blicen[cs]e\b", "\n".join(texts), re.I) and "ndarray" in "\n".join(texts)
