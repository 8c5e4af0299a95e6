"""Log-likelihoods of continuations under an ONNX graph on ONNX Runtime, computed as lm-eval's `hf` model does.

A (context, continuation) pair is tokenized as lm-eval 0.4.13 tokenizes it (trailing spaces of the context moved
to the continuation, the whole string encoded and split after the context's tokens, with the tokenizer's own special
tokens (BOS where it prepends one); an empty context is the BOS or EOS token) and scored on the context's and continuation's tokens, the oldest cut when they pass
the model's position limit. Pairs that share a context share its KV cache: the context but its last token runs once,
and its cache, copied once per continuation, is the past of one batch holding every continuation (each row starts at
the context's last KEPT tokens, the last of which scores the first continuation token: KEPT = 2, so that no run after
a cache is one token long, which int4 MatMulNBits computes with other kernels, 0.1 nats apart on SmolLM2). Rows are padded on the
right, which a causal graph never reads (with ops.ONE_ROW_AFTER_PAST, such as GenAI's GroupQueryAttention, each
continuation runs alone after the shared cache). Graphs without a KV cache, or that take no chunk of tokens after one
(tried once), score each pair's whole row instead. Only the
continuation tokens' log-probabilities leave the session (the scoring graph of measure/scoring.py).

like="onnxruntime" tokenizes and cuts as lm-eval's `onnxruntime` and `onnxruntime-genai` backends do instead
(docs/evaluation.md): no special tokens, and a pair past the position limit keeps its last max_length tokens (hf:
max_length + 1, the last of which is only a target). The shared cache stays: on the GenAI builder's SmolLM2 fp32 it
scores what whole rows score, as far from those backends' numbers (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from surgery.engine import runtime
from surgery.errors import SurgeryError
from surgery.files import config, graph, ops
from surgery.measure.scoring import NLL, TARGETS, TOP1, scoring_model
from surgery.text import data

KEPT = 2  # context tokens that run with the continuations: never a one-token run after a cache, whose kernels can differ
ROWS = 16  # rows per run when pairs are scored whole (no shared context)
DEFAULT_LENGTH = 2048  # lm-eval's when the model states no position limit
LIKE = ("hf", "onnxruntime")  # the lm-eval backends whose tokenization and cut a Likelihood can follow


class Likelihood:
    """One session that scores (context, continuation) pairs under `model` (an .onnx file or its folder, or a model in
    memory), with the tokenizer and config of `folder` (the model's own folder when None). like: tokenize and cut as
    lm-eval's `hf` backend (the tokenizer's special tokens) or its `onnxruntime` / `onnxruntime-genai` backends (none)."""

    def __init__(self, model: str | Path | ir.Model, options: runtime.Options = runtime.Options(), folder: str | Path | None = None,
                 like: str = "hf"):
        if folder is None and isinstance(model, ir.Model):
            raise SurgeryError("a model in memory is scored with the folder of its tokenizer and config")
        check_like(like)
        path = graph.resolve(folder if folder is not None else model)
        loaded = model if isinstance(model, ir.Model) else graph.load(path)
        self.presents = [v.name for v in loaded.graph.outputs if v.name.startswith("present")]
        self.session = runtime.session(scoring_model(loaded, keep=self.presents), options)
        self.cached = runtime.has_kv_cache(self.session) and bool(self.presents)
        self.one_row = any(node.op_type in ops.ONE_ROW_AFTER_PAST for node in loaded.graph.all_nodes())
        self.cached = self.cached and self._chunks_after_cache()
        self.tokenizer = data.load_tokenizer(path)
        self.max_length = config.position_limit(path.parent) or DEFAULT_LENGTH
        prefix = _special(path.parent, self.tokenizer, ("bos_token", "eos_token"))
        self.prefix_token = 0 if prefix is None else prefix  # lm-eval's token before an empty context
        self.prefix_text = self.tokenizer.decode([self.prefix_token], skip_special_tokens=False) or "\0"
        self.eos_token = _special(path.parent, self.tokenizer, ("eos_token",))
        self.bos = like == "hf"
        self.window = self.max_length + 1 if self.bos else self.max_length  # tokens a pair keeps past the limit (module docstring)

    def _chunks_after_cache(self) -> bool:
        """Whether the graph takes several tokens after a KV cache, as the shared-context runs feed it (the GenAI builder's
        fp16 CPU graphs take a prompt or one token only): tried once on two tokens after two, ORT's log kept quiet."""
        quiet = ort.RunOptions()
        quiet.log_severity_level = 4
        rows = np.zeros((1 if self.one_row else 2, KEPT), np.int64)
        try:
            past = {name: np.repeat(v, len(rows), axis=0) for name, v in self.cache([0] * KEPT, quiet).items()}
            self.session.run([NLL], runtime.feeds(self.session, rows, past, extra={TARGETS: rows}), quiet)
        except (ort.capi.onnxruntime_pybind11_state.InvalidArgument, ort.capi.onnxruntime_pybind11_state.Fail,
                ort.capi.onnxruntime_pybind11_state.RuntimeException):
            return False
        return True

    def cache(self, ids: list[int], run_options: ort.RunOptions | None = None) -> dict[str, np.ndarray]:
        """The KV cache after the tokens `ids` (one sequence), as the past of a next run."""
        row = np.array([ids], np.int64)
        presents = self.session.run(self.presents, runtime.feeds(self.session, row, extra={TARGETS: row}), run_options)
        return runtime.present_as_past(self.session, presents, self.presents)

    def encode(self, text: str) -> list[int]:
        """lm-eval's tok_encode: the tokenizer's own special tokens (BOS where its post-processor prepends one), none when
        the text starts with the prefix token's text already (`hf`) or when bos is False (`onnxruntime`, `onnxruntime-genai`)."""
        return self.tokenizer.encode(text, add_special_tokens=self.bos and not text.startswith(self.prefix_text)).ids

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
        for i, (context, _) in enumerate(pairs):
            groups.setdefault(tuple(context), []).append(i)
        whole = []
        for context, members in groups.items():
            longest = max(len(pairs[i][1]) for i in members)
            if self.cached and len(members) > 1 and len(context) + longest <= self.window:
                self._shared(list(context), members, pairs, results)
            else:
                whole += members
        whole.sort(key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        for lo in range(0, len(whole), ROWS):
            chunk = whole[lo : lo + ROWS]
            rows = [(pairs[i][0] + pairs[i][1])[-self.window :] for i in chunk]
            self._score(chunk, [r[:-1] for r in rows], [r[1:] for r in rows], [len(pairs[i][1]) for i in chunk], None, results)
        return results  # type: ignore[return-value]

    def _shared(self, context: list[int], members: list[int], pairs, results) -> None:
        keep = min(KEPT, len(context))
        past = None
        if len(context) > keep:
            past = self.cache(context[:-keep])
        batches = [[i] for i in members] if self.one_row and past else [members]
        for batch in batches:
            rows = [context[-keep:] + pairs[i][1] for i in batch]
            copies = None if past is None else {name: np.repeat(value, len(batch), axis=0) for name, value in past.items()}
            self._score(batch, [r[:-1] for r in rows], [r[1:] for r in rows], [len(pairs[i][1]) for i in batch], copies, results)

    def _score(self, members, rows, targets, lengths, past, results) -> None:
        width = max(map(len, rows))
        ids, goals = np.zeros((len(rows), width), np.int64), np.zeros((len(rows), width), np.int64)
        for r, (row, target) in enumerate(zip(rows, targets)):
            ids[r, : len(row)], goals[r, : len(target)] = row, target
        nll, top1 = self.session.run([NLL, TOP1], runtime.feeds(self.session, ids, past, extra={TARGETS: goals}))
        for r, (i, row, n) in enumerate(zip(members, rows, lengths)):
            span = slice(len(row) - n, len(row))
            results[i] = (-float(nll[r, span].astype(np.float64).sum()), bool((top1[r, span] == goals[r, span]).all()))


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
