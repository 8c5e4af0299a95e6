"""Log-likelihoods of continuations under an ONNX graph on ONNX Runtime, computed as lm-eval's `hf` model does.

A (context, continuation) pair is tokenized as lm-eval 0.4.13 tokenizes it (trailing spaces of the context moved
to the continuation, the whole string encoded and split after the context's tokens, with the tokenizer's own special
tokens (BOS where it prepends one); an empty context is the BOS or EOS token) and scored on the context's and
continuation's tokens, the oldest cut when they pass the model's position limit.

Pairs that share a context share its run: their stem (the context and the continuations' common first tokens) runs
once, and scores at its last position every continuation's first own token; its KV cache, copied once per
continuation, is the past of the runs that score each continuation's other tokens. Many documents run together: their
stems, sorted by length, in runs of similar lengths (rows padded on the right, which a causal graph never reads; _cuts),
then their continuations, sorted by length, in batches after their stems' caches (cut as the stems are, or ROWS rows
where the batch steps one token a run), each row's past masked to its own stem (attention_mask zero over the padding; positions counted from the mask). Graphs that take
several tokens after a cache for one sequence only (ops.ONE_ROW_AFTER_PAST, such as GenAI's GroupQueryAttention) step
the batch one token a run instead, the rows done leaving it. A run after a cache always holds two rows or more: int4
MatMulNBits computes a one-token, one-row run with other kernels (0.1 nats apart on SmolLM2). Which of these a graph
takes is tried once, on a few tokens, against whole rows; graphs without a KV cache, or that take none of them, score
each pair's whole row (WHOLE a run). The vocabulary projection runs at the scored positions only, and only their
log-probabilities leave the session (the scoring graph of measure/scoring.py, select=True).

like="onnxruntime" scores as lm-eval's `onnxruntime` and `onnxruntime-genai` backends do instead (LIKE,
docs/evaluation.md): no special tokens; a pair past the position limit keeps its last max_length tokens (hf:
max_length + 1, the last of which is only a target); the log-softmax exact to float rounding, as NumPy's (hf: summed in
float, as torch's, whose log-probabilities on SmolLM2's 49152 words are 1.8e-5 nats a token high).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from surgery.engine import runtime
from surgery.errors import SurgeryError
from surgery.files import config, graph, ops
from surgery.measure.scoring import NLL, POSITIONS, TARGETS, TOP1, scoring_model
from surgery.text import data

ROWS = 64  # items (stems, or rows of continuations after their stems' caches) a run or a batch holds at most
WHOLE = 16  # rows per run when pairs are scored whole
TOKENS = 2048  # tokens, padding included, of a run at most (_cuts)
RUN = 16  # what a run costs besides its tokens, in tokens (reading the weights once): _cuts
DEFAULT_LENGTH = 2048  # lm-eval's when the model states no position limit


@dataclasses.dataclass(frozen=True)
class Backend:
    """Where lm-eval's backends score a pair differently, and a Likelihood follows the one it is `like`."""

    special_tokens: bool  # the tokenizer's own (BOS first) or none
    past_limit: int  # tokens a pair keeps beyond the position limit (hf: one, only a target)
    float_sum: bool  # log-softmax as torch's float32 one (its exponentials summed in float, 1.8e-5 nats a token high on
    # SmolLM2, as ORT's LogSoftmax) or exact to float rounding (NumPy's: measure/scoring.py's blocked sum)


LIKE = {"hf": Backend(True, 1, True), "onnxruntime": Backend(False, 0, False)}  # lm-eval's backends Likelihood can follow
PROBE = ([1, 2, 3], [4, 5]), ([1, 2, 3], [4, 6, 7]), ([8, 9, 10, 11, 12], [13]), ([8, 9, 10, 11, 12], [14, 15])


@dataclasses.dataclass(frozen=True)
class Stem:
    """Pairs that share a context (`members`, indices of the pairs): the tokens every one of their rows starts with (the
    context and the continuations' common first tokens, one token short of the shortest row) and the context's length."""

    tokens: tuple[int, ...]
    context: int
    members: tuple[int, ...]

    @classmethod
    def of(cls, context: list[int], members: list[int], pairs) -> Stem:
        rows = [context + pairs[i][1] for i in members]
        shared = min(map(len, rows)) - 1
        for at in range(len(context), shared):
            if any(row[at] != rows[0][at] for row in rows):
                shared = at
                break
        return cls(tuple(rows[0][: max(shared, len(context))]), len(context), tuple(members))


class Likelihood:
    """One session that scores (context, continuation) pairs under `model` (an .onnx file or its folder, or a model in
    memory), with the tokenizer and config of `folder` (the model's own folder when None). like: tokenize and cut as
    lm-eval's `hf` backend (the tokenizer's special tokens) or its `onnxruntime` / `onnxruntime-genai` backends (none).
    width: the tokens a run takes per row after the stems' caches (None: all, 1: one, as a decoding step); cached: whether
    pairs share their stems' runs at all (module docstring)."""

    def __init__(self, model: str | Path | ir.Model, options: runtime.Options = runtime.Options(), folder: str | Path | None = None,
                 like: str = "hf"):
        if folder is None and isinstance(model, ir.Model):
            raise SurgeryError("a model in memory is scored with the folder of its tokenizer and config")
        check_like(like)
        path = graph.resolve(folder if folder is not None else model)
        loaded = model if isinstance(model, ir.Model) else graph.load(path)
        self.presents = [v.name for v in loaded.graph.outputs if v.name.startswith("present")]
        self.like = LIKE[like]
        self.session = runtime.session(scoring_model(loaded, keep=self.presents, select=True, float_sum=self.like.float_sum), options)
        self.one_row = any(node.op_type in ops.ONE_ROW_AFTER_PAST for node in loaded.graph.all_nodes())
        self.width: int | None = None
        self.tokenizer = data.load_tokenizer(path)
        self.max_length = config.position_limit(path.parent) or DEFAULT_LENGTH
        prefix = _special(path.parent, self.tokenizer, ("bos_token", "eos_token"))
        self.prefix_token = 0 if prefix is None else prefix  # lm-eval's token before an empty context
        self.prefix_text = self.tokenizer.decode([self.prefix_token], skip_special_tokens=False) or "\0"
        self.eos_token = _special(path.parent, self.tokenizer, ("eos_token",))
        self.window = self.max_length + self.like.past_limit  # tokens a pair keeps past the limit (module docstring)
        self.cached = runtime.has_kv_cache(self.session) and bool(self.presents) and self._after_caches()

    def _after_caches(self) -> bool:
        """Which runs after the stems' caches the graph takes (self.width), tried once on PROBE against its whole rows, ORT's
        log kept quiet: a chunk of tokens per row, else one token per row (the GenAI builder's fp16 CPU graphs), else none."""
        quiet = ort.RunOptions()
        quiet.log_severity_level = 4
        whole: list = [None] * len(PROBE)
        self._whole(list(range(len(PROBE))), PROBE, whole)
        for width in ([1] if self.one_row else [None, 1]):
            self.width = width
            got: list = [None] * len(PROBE)
            try:
                self._shared([Stem.of(list(PROBE[i][0]), [i, i + 1], PROBE) for i in (0, 2)], PROBE, got, quiet)
            except (ort.capi.onnxruntime_pybind11_state.InvalidArgument, ort.capi.onnxruntime_pybind11_state.Fail,
                    ort.capi.onnxruntime_pybind11_state.RuntimeException):
                continue
            if np.allclose([g[0] for g in got], [w[0] for w in whole], rtol=1e-4, atol=1e-3):
                return True
        return False

    def next_token(self, ids: list[int], past: dict[str, np.ndarray] | None = None) -> tuple[int, dict[str, np.ndarray] | None]:
        """The most likely token after `ids` (one sequence, after `past` when given), and the KV cache after `ids` (None
        where the graph's cache is not used: the next call then passes the whole sequence)."""
        row = np.array([ids], np.int64)
        feed = runtime.feeds(self.session, row, past, extra={TARGETS: np.zeros((1, 1), np.int64), POSITIONS: np.array([len(ids) - 1])})
        top1, *presents = self.session.run([TOP1, *(self.presents if self.cached else [])], feed)
        return int(top1[0, 0]), runtime.present_as_past(self.session, presents, self.presents) if self.cached else None

    def encode(self, text: str) -> list[int]:
        """lm-eval's tok_encode: the tokenizer's own special tokens (BOS where its post-processor prepends one), none when
        the text starts with the prefix token's text already (`hf`) or when bos is False (`onnxruntime`, `onnxruntime-genai`)."""
        return self.tokenizer.encode(text, add_special_tokens=self.like.special_tokens and not text.startswith(self.prefix_text)).ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's split of a pair into context and continuation tokens."""
        if not context:
            return [self.prefix_token], self.encode(continuation)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, head = self.encode(context + continuation), self.encode(context)
        return head, whole[len(head) :]

    def __call__(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(log-likelihood in nats, whether greedy decoding gives the continuation) of each pair."""
        return self.tokens([self.encode_pair(c, x) for c, x in pairs])

    def tokens(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """`__call__` for pairs already tokenized."""
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (context, continuation) in enumerate(pairs):
            if continuation:
                groups.setdefault(tuple(context), []).append(i)
            else:
                results[i] = (0.0, True)  # nothing to score, as lm-eval
        stems, whole = [], []
        for context, members in groups.items():
            if context and len(context) + max(len(pairs[i][1]) for i in members) <= self.window:
                stems.append(Stem.of(list(context), members, pairs))
            else:
                whole += members
        if self.cached and sum(len(s.members) for s in stems) > 1:
            self._shared(stems, pairs, results)
        else:
            whole += [i for s in stems for i in s.members]
        self._whole(whole, pairs, results)
        return results  # type: ignore[return-value]

    def _whole(self, members: list[int], pairs, results) -> None:
        """Score each pair's whole row, the longest first, WHOLE rows a run."""
        members = sorted(members, key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        for lo in range(0, len(members), WHOLE):
            chunk = members[lo : lo + WHOLE]
            rows = [(list(pairs[i][0]) + list(pairs[i][1]))[-self.window :] for i in chunk]
            scored = [(r, len(row) - 1 - len(pairs[i][1]), row[len(row) - len(pairs[i][1]) :]) for r, (i, row) in enumerate(zip(chunk, rows))]
            for i, result in zip(chunk, self._run(_padded([r[:-1] for r in rows]), scored, cache=False)[0]):
                results[i] = result

    def _shared(self, stems: Sequence[Stem], pairs, results, run_options: ort.RunOptions | None = None) -> None:
        """Score the pairs of `stems` (two rows or more): the stems, the shortest first, up to TOKENS (padded) a run, each
        scoring its continuations' common tokens and, at its last position, every continuation's next one; then every
        continuation's other tokens after its stem's cache, the shortest first, in batches cut as the stems are (ROWS rows
        a batch where it steps one token a run)."""
        stems = sorted(stems, key=lambda s: len(s.tokens))
        tails = {i: pairs[i][1][len(s.tokens) - s.context :] for s in stems for i in s.members}  # each row's own tokens
        caches: list[dict[str, np.ndarray]] = []
        first: dict[int, tuple[float, bool]] = {}  # each row's tokens scored in its stem's run
        for run in _cuts([len(s.tokens) for s in stems]):
            chunk = stems[run.start : run.stop]
            scored = [(j, s.context - 1, s.tokens[s.context :]) for j, s in enumerate(chunk)]
            scored += [(j, len(s.tokens) - 1, tails[i][:1]) for j, s in enumerate(chunk) for i in s.members]
            got, past = self._run(_padded([s.tokens for s in chunk]), scored, run_options=run_options)
            common, own = got[: len(chunk)], iter(got[len(chunk) :])
            for j, s in enumerate(chunk):
                for i in s.members:
                    value, right = next(own)
                    first[i] = (common[j][0] + value, common[j][1] and right)
            caches += [{n: v[j : j + 1, :, : len(s.tokens)] for n, v in past.items()} for j, s in enumerate(chunk)]
        rows = sorted(((k, i) for k, s in enumerate(stems) for i in s.members if len(tails[i]) > 1),
                      key=lambda row: (len(tails[row[1]]), len(stems[row[0]].tokens)))
        for i in {i for s in stems for i in s.members} - {i for _, i in rows}:
            results[i] = first[i]
        rows = rows * 2 if len(rows) == 1 else rows  # two rows a run after a cache (module docstring): a copy
        widths = [len(tails[i]) - 1 for _, i in rows]  # tokens a row runs: a batch of chunks is padded to its longest
        batches = _cuts(widths, least=2) if self.width is None else np.array_split(range(len(rows)), -(-len(rows) // ROWS)) if rows else []
        for batch in batches:
            chosen = [rows[b] for b in batch]
            past, mask = _stacked([caches[k] for k, _ in chosen])
            for (_, i), (value, right) in zip(chosen, self._rows([tails[i] for _, i in chosen], past, mask, run_options)):
                results[i] = (first[i][0] + value, first[i][1] and right)

    def _rows(self, inputs: list[list[int]], past, mask: np.ndarray, run_options) -> list[tuple[float, bool]]:
        """Each row's tokens after its past (mask: which past positions are its own), the first only an input and the last
        only a target: their log-likelihood and whether every target is the top-1, self.width tokens a run, rows done
        leaving the batch (but one, so that no run holds a single row)."""
        sums, right = np.zeros(len(inputs)), np.ones(len(inputs), bool)
        longest = max(map(len, inputs)) - 1
        step = self.width or longest
        slots = list(range(len(inputs)))  # the rows in the batch, in order
        for lo in range(0, longest, step):
            live = [r for r in slots if len(inputs[r]) - 1 > lo]
            live += [r for r in slots if r not in live][: max(0, 2 - len(live))]
            if len(live) < len(slots):
                at = np.array([slots.index(r) for r in live])
                past = None if past is None else {n: v[at] for n, v in past.items()}
                mask, slots = mask[at], live
            mask = np.concatenate([mask, np.ones((len(slots), step), np.int64)], axis=1)
            scored = [(p, 0, inputs[r][lo + 1 : lo + 1 + step]) for p, r in enumerate(slots)]
            got, past = self._run(_padded([inputs[r][lo : lo + step] for r in slots], step), scored, past, mask, run_options)
            for r, (value, same) in zip(slots, got):
                sums[r] += value
                right[r] &= same
        return list(zip(sums.tolist(), right.tolist()))

    def _run(self, ids: np.ndarray, scored: Sequence[tuple[int, int, Sequence[int]]], past=None, mask=None, run_options=None,
             cache: bool = True):
        """One run of `ids` [rows, width] (after `past`, masked by `mask`, when given): for each (row, position of the first
        target, target tokens) of `scored`, the targets' log-likelihood and whether each is the top-1 (a position may be
        scored against several targets); and the KV cache after the run (cache; None without)."""
        width = ids.shape[1]
        positions = [row * width + start + np.arange(len(goal)) for row, start, goal in scored]
        flat = np.concatenate(positions + [np.zeros(1, np.int64)])  # one more, so that no run scores nothing
        targets = np.concatenate([np.asarray(goal, np.int64) for _, _, goal in scored] + [np.zeros(1, np.int64)])
        feed = runtime.feeds(self.session, ids, past, extra={TARGETS: targets[None], POSITIONS: flat}, mask=mask)
        nll, top1, *presents = self.session.run([NLL, TOP1, *(self.presents if cache else [])], feed, run_options)
        bounds = np.cumsum([0] + [len(goal) for _, _, goal in scored])
        got = [_sums(nll[0, lo:hi], top1[0, lo:hi] == targets[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]
        return got, runtime.present_as_past(self.session, presents, self.presents) if presents else None


def _padded(rows: Sequence[Sequence[int]], width: int | None = None) -> np.ndarray:
    """int64 [len(rows), width (the longest row)] of the rows, zeros on the right."""
    out = np.zeros((len(rows), width if width is not None else max(map(len, rows))), np.int64)
    for r, row in enumerate(rows):
        out[r, : len(row)] = row
    return out


def _cuts(widths: Sequence[int], least: int = 1) -> list[range]:
    """Items of ascending `widths` cut into runs, each padded to its widest, at the least cost: the tokens run, padding
    included, and RUN more a run; at most ROWS items and TOKENS tokens a run (one item may pass TOKENS alone), at
    least `least` items a run where there are that many."""
    best, cut = [0.0] + [np.inf] * len(widths), [0] * (len(widths) + 1)
    for end in range(1, len(widths) + 1):
        for start in range(end - least, max(-1, end - 1 - ROWS), -1):
            if start < 0 or (start < end - least and (end - start) * widths[end - 1] > TOKENS):
                break
            cost = best[start] + (end - start) * widths[end - 1] + RUN
            if cost < best[end]:
                best[end], cut[end] = cost, start
    if len(widths) and not np.isfinite(best[-1]):  # fewer items than `least`
        return [range(len(widths))]
    runs, end = [], len(widths)
    while end:
        runs.insert(0, range(cut[end], end))
        end = cut[end]
    return runs


def _stacked(caches: Sequence[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One past of the rows' own caches, padded on the right to the longest, and its attention mask."""
    lengths = [next(iter(c.values())).shape[2] for c in caches]
    mask = (np.arange(max(lengths))[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    past = {}
    for name, value in caches[0].items():
        past[name] = np.zeros((len(caches), value.shape[1], max(lengths), value.shape[3]), value.dtype)
        for r, cache in enumerate(caches):
            past[name][r, :, : lengths[r]] = cache[name][0]
    return past, mask


def _sums(nll: np.ndarray, right: np.ndarray) -> tuple[float, bool]:
    """A span's log-likelihood (float64 sum of its NLLs, negated) and whether all its targets are the top-1."""
    return -float(nll.astype(np.float64).sum()), bool(right.all())


def check_like(like: str) -> None:
    """Refuse a `like` that names no backend Likelihood can follow (SurgeryError, one line)."""
    if like not in LIKE:
        raise SurgeryError(f"cannot score like lm-eval's {like!r} backend; use one of {', '.join(LIKE)}")


def _special(folder: Path, tokenizer, keys: tuple[str, ...]) -> int | None:
    """The id of the first of the special tokens `keys` (bos_token, eos_token) that tokenizer_config.json names; None if none."""
    settings = folder / "tokenizer_config.json"
    named = json.loads(settings.read_text()) if settings.is_file() else {}
    for key in keys:
        token = named.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    return None
