import json

import numpy as np
import pytest

from surgery.errors import SurgeryError
from surgery.text import data


def test_default_corpus_is_pydoc_topics_in_sorted_order():
    from pydoc_data.topics import topics

    text = data.default_corpus()
    first, last = sorted(topics)[0], sorted(topics)[-1]
    assert text.startswith(topics[first]) and text.endswith(topics[last])


def test_windows_start_with_the_tokenizers_own_bos(fixture_path):
    w = data.windows(fixture_path("llama"), "text", seq_len=64, max_windows=5)
    assert w.ids.shape == (5, 64) and (w.ids[:, 0] == 0).all()  # the fixture tokenizer prepends id 0
    assert w.tokens == 5 * 63
    every = data.windows(fixture_path("llama"), "text", seq_len=64)
    assert w.starts[0] == every.starts[0] and w.starts[-1] == every.starts[-1]  # spread over the part


def test_calibration_and_evaluation_windows_are_disjoint(fixture_path):
    cal = data.windows(fixture_path("llama"), "text", seq_len=32, part="calibration")
    ev = data.windows(fixture_path("llama"), "text", seq_len=32, part="evaluation")
    everything = data.windows(fixture_path("llama"), "text", seq_len=32, part="all")
    assert len(cal) > 0 and len(ev) > 2 * len(cal)
    body = 31  # tokens per window after BOS
    covered = lambda w: {int(s) + i for s in w.starts for i in range(body)}  # noqa: E731
    assert not covered(cal) & covered(ev)  # no token in both parts
    assert len(cal) + len(ev) == len(everything)
    span = everything.starts.max()
    assert cal.starts.min() < span / 10 and cal.starts.max() > span * 0.9  # interleaved: both parts span the corpus
    stream = data.token_stream(*data.read_texts("text")[:1], data.load_tokenizer(fixture_path("llama")))
    for w in (cal, ev):  # each window holds the corpus tokens from its start
        for row, start in zip(w.ids[::50], w.starts[::50]):
            np.testing.assert_array_equal(row[1:], stream[start : start + body])


@pytest.mark.parametrize("prefix", [[], [7]])
@pytest.mark.parametrize("stride", [None, 5, 9, 12])
def test_every_token_is_scored_once(prefix, stride):
    stream = np.arange(100, 160)
    seq_len, body = 12 + len(prefix), 12
    w = data.make_windows(stream, seq_len=seq_len, stride=stride, prefix=prefix, name="s")
    scored = []  # stream offsets of scored targets; target t is ids[t + 1]
    for row, start, first in zip(w.ids, w.starts, w.score_from):
        for t in range(first, seq_len - 1):
            offset = start + t + 1 - len(prefix)
            assert row[t + 1] == stream[offset]
            scored.append(offset)
    assert len(scored) == len(set(scored)) == w.tokens  # nothing twice
    end = w.starts[-1] + body
    unscored = {0} if not prefix else set()  # the first token has no context without BOS
    if not prefix and (stride or body) == body:
        unscored = set(w.starts.tolist())  # windows that do not overlap: each one's first token
    assert set(scored) == set(range(end)) - unscored


def test_the_default_is_text_and_the_models_own_samples_half_and_half(fixture_path):
    """The default corpus: half of each part's windows the built-in text, half samples the model wrote itself,
    spread over each other; the parts' samples differ, and each is the model's own next-token draw. Asked for every
    window, it is every text window."""
    from surgery.engine import runtime
    from surgery.text import corpus

    model = fixture_path("llama")
    cal = data.windows(model, seq_len=32, max_windows=10, part="calibration")
    ev = data.windows(model, seq_len=32, max_windows=10, part="evaluation")
    text = data.windows(model, "text", seq_len=32, max_windows=5, part="calibration")
    assert (cal.starts < 0).sum() == 5 and (cal.starts[::2] >= 0).all() and (cal.starts[1::2] < 0).all()
    np.testing.assert_array_equal(cal.ids[cal.starts >= 0], text.ids)  # the text windows as `text` gives them
    assert (cal.score_from[cal.starts < 0] == 0).all() and (cal.ids[:, 0] == 0).all()  # BOS first, every target scored
    assert not {tuple(r) for r in cal.ids[cal.starts < 0]} & {tuple(r) for r in ev.ids[ev.starts < 0]}
    fewer = data.windows(model, seq_len=32, max_windows=4, part="calibration")
    np.testing.assert_array_equal(fewer.ids[fewer.starts < 0], cal.ids[cal.starts < 0][:2])  # row r does not depend on the count
    # each sampled token is the Gumbel-max draw of the model's own next-token distribution: the largest logit plus the
    # row's generator's Gumbel noise (full recompute without the KV cache, float64)
    sess, samples = runtime.session(model), cal.ids[cal.starts < 0]
    for r in (0, 3):
        rng = np.random.default_rng([data.SEEDS["calibration"], r])
        for t in range(1, 32):
            logits = sess.run(["logits"], runtime.feeds(sess, samples[r : r + 1, :t]))[0][0, -1].astype(np.float64)
            assert samples[r, t] == np.argmax(logits + rng.gumbel(size=logits.shape))
    assert corpus.samples(model, 0, 32, [0], 1).shape == (0, 32)
    every = data.windows(model, seq_len=32, part="evaluation")  # no count: every text window, no samples
    np.testing.assert_array_equal(every.ids, data.windows(model, "text", seq_len=32, part="evaluation").ids)


def test_the_gumbel_draw_samples_the_softmax_and_float_noise_in_the_logits_does_not_move_it():
    """corpus.draw: `gumbel` draws each token with its softmax probability; with logits moved by 1e-5 relative noise
    (more than float32 rounding) over a 32,000-token vocabulary with a long tail, the inverse-CDF rule moves some of
    1,000 draws to another token, the Gumbel-max rule none."""
    from surgery.text import corpus

    p = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
    drawn = np.concatenate([corpus.draw(np.log(np.tile(p, (1000, 1))), [np.random.default_rng([3, r]) for r in range(k, k + 1000)])
                            for k in range(0, 20_000, 1000)])
    share = np.bincount(drawn, minlength=5) / len(drawn)
    assert (np.abs(share - p) <= 4 * np.sqrt(p * (1 - p) / len(drawn))).all(), share  # within 4 standard errors of each probability
    rng = np.random.default_rng(0)
    logits = np.sort(rng.standard_normal((1000, 32_000)), axis=1)[:, ::-1] * 3.0 * np.linspace(1.0, 1.6, 32_000)
    noisy = logits * (1 + 1e-5 * rng.standard_normal(logits.shape))
    rngs = lambda: [np.random.default_rng([7, r]) for r in range(1000)]  # noqa: E731
    moved = {rule: int((corpus.draw(logits, rngs(), rule) != corpus.draw(noisy, rngs(), rule)).sum()) for rule in corpus.RULES}
    assert moved["inverse"] > 0 and moved["gumbel"] == 0, moved


def test_jsonl_and_text_files(tmp_path, fixture_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"Line number {i} of the corpus."}) for i in range(40)))
    txt = tmp_path / "c.txt"
    txt.write_text(" ".join(f"Line number {i} of the corpus." for i in range(40)))
    for path in (jsonl, txt):
        w = data.windows(fixture_path("gpt2"), path, seq_len=16, part="all")
        assert len(w) > 5


@pytest.mark.parametrize(
    "content,message",
    [(b"", "has no text"), (b"\xff\xfe\x00binary", "cannot read"), (b'{"text": "ok"}\nnot json\n', "line 2 is not JSON"),
     (b'{"body": "x"}\n', "no string `text` field"), (b"too short", "fewer than one window")],
)
def test_bad_corpora_are_one_clear_error(tmp_path, fixture_path, content, message):
    path = tmp_path / ("c.jsonl" if b"{" in content else "c.txt")
    path.write_bytes(content)
    with pytest.raises(SurgeryError, match=message):
        data.windows(fixture_path("llama"), path, seq_len=64)


def test_missing_tokenizer_names_the_fix(tmp_path, fixture_path):
    (tmp_path / "model.onnx").write_bytes((fixture_path("llama") / "model.onnx").read_bytes())
    with pytest.raises(SurgeryError, match="found no tokenizer .* --tokenizer"):
        data.windows(tmp_path, seq_len=64)
    w = data.windows(tmp_path / "model.onnx", seq_len=64, tokenizer=fixture_path("llama"), max_windows=2)
    assert len(w) == 2


@pytest.mark.parametrize("count", [0, -1])
def test_asking_for_no_windows_is_an_error_not_an_empty_set(fixture_path, count):
    with pytest.raises(SurgeryError, match=f"{count} windows asked for"):
        data.windows(fixture_path("llama"), seq_len=32, max_windows=count)
