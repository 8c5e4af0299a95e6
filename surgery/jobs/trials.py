"""The selection's trials: each one scores a chosen set of parallel blocks against the original on the selection
windows, in one switchboard session (here or on Ray actors), resumed from the accepted set's stream where it can be."""

from __future__ import annotations

import functools

import onnx_ir as ir

from surgery.analysis import resumable
from surgery.analysis import switchboard as board_graph
from surgery.analysis.fit_graph import Form, kinds, switched
from surgery.compensation import memory
from surgery.engine import cluster, runtime
from surgery.errors import SurgeryError
from surgery.files import checkpoint
from surgery.files.checkpoint import Checkpoints
from surgery.measure import scoring, statistics
from surgery.measure.statistics import Delta
from surgery.model.subject import Subject
from surgery.passes import Fix
from surgery.passes.common import narrower_than_float32
from surgery.text import data
from surgery.text.data import Windows

BATCH = 4  # selection windows scored together: one job for a Ray actor
KEEP_BYTES = 1 << 30  # the streams a resumed trial starts from (at the stops): at most this, or an eighth of the available memory


class TrialScorer(scoring.Scorer):
    """A switchboard's scoring session (here or on a Ray actor) that runs one batch of selection windows at a time."""

    def run(self, windows: Windows, extra: dict, reference=None) -> tuple[statistics.Perplexity, dict | None, list | None]:
        """The batch's score (KL and top-1 against `reference`, when given); the streams it keeps; without a reference,
        its own log-probs (the original's Reference of the batch)."""
        checkpoint.reached("trial batch")
        kept, record = ({} if self.keep else None), ([] if reference is None else None)
        scored = self(windows, batch_size=len(windows), extra=extra, kept=kept, reference=None if reference is None else [reference], record=record)
        return scored, kept, record


class Trials:
    """The selection's trials: the switchboard of the two forms (fit_graph.kinds) with the fixes in one scoring session, each trial the whole
    chosen set against the original on the selection windows, in batches of BATCH.

    Resumed (in this process, float32 or wider, when the graph allows: resumable.resumable): the session keeps the
    residual stream of the set accepted so far at stops (the candidates' blocks, as many as KEEP_BYTES
    holds), and a trial that adds block l to it starts at the last stop <= l, from that stream, since no block
    before l differs from the accepted set's. A trial then costs the blocks from there on and the logits.

    Each trial's numbers are a checkpoint unit (`work`): a resumed selection reads the trials an interrupted one
    finished instead of running them, and before its first new trial runs the accepted set once to rebuild the
    streams it keeps."""

    def __init__(self, model: "ir.Model | Subject", fixes: dict[int, Fix], windows: Windows, candidates: list[int], pool: cluster.Pool,
                 options: runtime.Options, baseline: "Trials | None" = None, work: Checkpoints | None = None):
        """baseline: Trials of the same model and windows whose unchanged run to reuse (no resumed trials then)."""
        subject = Subject.of(model)
        blocks = subject.blocks
        self.subject, self.windows, self.pool, self.options = subject, windows, pool, options  # what a refit's trials run with too
        self.n = len(blocks)
        board = board_graph.switchboard(subject, kinds(fixes))
        resume = None
        if baseline is None and not pool.distributed and not narrower_than_float32(subject.stream):
            resume = resumable.resumable(board, blocks)
        self.batches = [windows.take(range(i, min(i + BATCH, len(windows)))) for i in range(0, len(windows), BATCH)]
        self.work = work or Checkpoints.off()
        self.resume, self.stops = resume, ()
        if resume is not None:  # as the interrupted run placed them, when this one resumes it (the memory may read otherwise now)
            self.stops = tuple(self.work.load("stops") or _stops(subject, windows, candidates, self.n))
            self.work.save("stops", list(self.stops))
        keep = tuple(resume.resid_post[c - 1] for c in self.stops) if resume else ()
        make = functools.partial(TrialScorer, options=pool.options(options), compare=True, keep=keep)
        self.scorers = pool.actors(resume.model if resume else board, make)
        self.passes, self.blocks_run = 0, 0
        self.stale = None  # the accepted set of the last trial read back from `work`, whose streams are to be rebuilt
        self.streams: list[dict] = [{} for _ in self.batches]  # per batch: the accepted set's stream at each stop
        self.base, self.reference = (baseline.base, baseline.reference) if baseline else self._baseline()

    def _baseline(self) -> tuple[statistics.Perplexity, list]:
        parts = list(self.scorers.map("run", [(batch, self._extra({}, 0, b)) for b, batch in enumerate(self.batches)]))
        self.passes, self.blocks_run = self.passes + 1, self.blocks_run + self.n
        self.streams = [kept or {} for _, kept, _ in parts]
        reference = [self.scorers.share(r) for _, _, refs in parts for r in refs]  # [BATCH, seq, vocab] float32, sent to Ray actors once
        return statistics.joined([p for p, _, _ in parts]), reference

    def _extra(self, forms: dict[int, Form], start: int, batch: int) -> dict:
        extra = {board_graph.SWITCHES: switched(self.n, forms)}
        return extra | self.resume.inputs(start, self.streams[batch]) if self.resume else extra

    def start(self, layer: int) -> int:
        """Where a trial adding `layer` to the accepted set starts: the last stop at or before it, or block 0."""
        return max((c for c in self.stops if c <= layer), default=0)

    def loss(self, forms: dict[int, Form], new: int | None = None) -> tuple[Delta, statistics.Divergence, dict]:
        """dNLL and KL of the blocks in `forms` against the original; `new`: the one block `forms` adds to the accepted
        set (None: run from block 0). Also what `accept` needs to make it the accepted set."""
        unit, start = f"trial-{self.passes}", 0 if new is None else self.start(new)
        if (done := self.work.load(unit)) is not None:
            if done["forms"] != forms:
                raise SurgeryError(f"the checkpoint {unit} is of another trial; add --restart to discard the work folder")
            self.passes, self.blocks_run = self.passes + 1, self.blocks_run + done["blocks_run"]
            return done["delta"], done["divergence"], {"read": forms}
        if self.stale is not None:
            self._rebuild(self.stale)
        jobs = [(batch, self._extra(forms, start, b), ref) for b, (batch, ref) in enumerate(zip(self.batches, self.reference))]
        parts = list(self.scorers.map("run", jobs, unit=f"selection trial {self.passes}"))
        self.passes += 1
        self.blocks_run += self.n - start
        p = statistics.joined([part for part, _, _ in parts])
        d, kl = statistics.delta(self.base, p), statistics.divergence(p, self.base)
        self.work.save(unit, {"forms": forms, "delta": d, "divergence": kl, "blocks_run": self.n - start})
        checkpoint.reached(f"selection {unit}")
        return d, kl, {"start": start, "kept": [kept for _, kept, _ in parts]}

    def accept(self, trial: dict) -> None:
        """Make a trial's set the accepted one: the streams at stops after its start come from its run."""
        if not self.resume:
            return
        if "read" in trial:  # read back from a checkpoint: its streams are rebuilt before the next trial runs
            self.stale = trial["read"]
            return
        later = {self.resume.resid_post[c - 1] for c in self.stops if c > trial["start"]}
        for streams, kept in zip(self.streams, trial["kept"]):
            streams.update({name: kept[name] for name in later})

    def _rebuild(self, forms: dict[int, Form]) -> None:
        """The accepted set's streams at every stop, from one run of it from block 0 (a resumed selection's,
        before its first new trial; not counted in passes)."""
        jobs = [(batch, self._extra(forms, 0, b), ref) for b, (batch, ref) in enumerate(zip(self.batches, self.reference))]
        self.streams = [kept for _, kept, _ in self.scorers.map("run", jobs)]
        self.stale = None


def _stops(subject: Subject, windows: Windows, candidates: list[int], n: int) -> list[int]:
    """The blocks at whose input a resumed trial may start: the candidates' (block 0 needs none), spread, as many as
    KEEP_BYTES (or an eighth of the available memory) holds of the selection windows' streams."""
    per_block = windows.ids.size * subject.stream.itemsize * subject.d_model
    room = max(1, min(KEEP_BYTES, (memory.available_memory() or KEEP_BYTES * 8) // 8) // max(per_block, 1))
    layers = sorted({l for l in candidates if 0 < l < n})
    return [layers[i] for i in data.spread(len(layers), room)]
