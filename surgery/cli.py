"""The `surgery` command line: parse, call one library function, print. No graph logic here."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from surgery.errors import SurgeryError

app = typer.Typer(
    help="Find, rewrite and measure the transformer blocks of exported ONNX language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped output is not wrapped, so tensor names stay whole for grep; a terminal folds long names.
out = Console(width=None if sys.stdout.isatty() else 10_000)
err = Console(stderr=True)


def _command(fn):
    """Register a command whose SurgeryError becomes `error: ...` on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SurgeryError as e:
            err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return app.command()(wrapper)


@_command
def export(
    source: Annotated[str, typer.Argument(help="Hub id, local HF folder, .gguf file, or `smollm2-135m` (bundled).")],
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Folder to create for model.onnx, config and tokenizer.")],
    past: Annotated[bool, typer.Option("--past/--no-past", help="Export the KV-cache graph (optimum only).")] = True,
    gguf_file: Annotated[Optional[str], typer.Option(help="GGUF file inside SOURCE's folder or hub repository.")] = None,
    opset: Annotated[Optional[int], typer.Option(help="ONNX opset; the exporter's default when unset.")] = None,
    exporter: Annotated[str, typer.Option(help="`optimum` (KV cache, ORTModelForCausalLM) or `dynamo` (torch.onnx).")] = "optimum",
    validate: Annotated[bool, typer.Option(help="Compare ONNX Runtime with torch after export (optimum).")] = False,
) -> None:
    """Export a Hugging Face causal LM to an ONNX folder that optimum and ONNX Runtime can run."""
    from surgery.export import export as run_export

    with contextlib.redirect_stdout(sys.stderr):  # exporters print progress; stdout is for results
        result = run_export(source, out_dir, past=past, gguf_file=gguf_file, opset=opset, exporter=exporter, validate=validate)
    kv = "with KV cache" if result.past else "no KV cache"
    tok = "" if result.has_tokenizer else " (no tokenizer found: evaluation will need one)"
    out.print(
        f"exported {result.model_type}, {result.n_layers} layers, {kv}, by {result.exporter} "
        f"in {result.seconds:.1f} s -> {result.folder}{tok}",
        highlight=False,
    )


@_command
def inspect(
    model: Annotated[Path, typer.Argument(help="ONNX file or folder from `surgery export`.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the facts and block map as JSON.")] = False,
) -> None:
    """Show each transformer block found in the graph, and facts about the model."""
    from surgery.facts import describe

    facts = describe(model)
    if as_json:
        print(json.dumps(facts.to_json(), indent=2))
        return
    kv_inputs = [t for t in facts.inputs if t.name.startswith("past_key_values")]
    other_inputs = [t for t in facts.inputs if t not in kv_inputs]
    kv_outputs = [t for t in facts.outputs if t.name.startswith("present")]
    other_outputs = [t for t in facts.outputs if t not in kv_outputs]
    size = f"{facts.size_bytes / 2**20:.1f} MiB"
    if facts.external_data:
        size += f" (external data: {', '.join(facts.external_data)})"
    lines = [
        ("model", facts.path),
        ("blocks", f"{facts.n_layers} {facts.form}"),
        ("d_model", str(facts.d_model or "?")),
        ("vocab", str(facts.vocab or "?")),
        ("inputs", ", ".join(f"{t.name} {t.dtype}{t.shape}" for t in other_inputs)),
        ("outputs", ", ".join(f"{t.name} {t.dtype}{t.shape}" for t in other_outputs)),
        (
            "KV cache",
            f"yes: {len(kv_inputs)} past inputs {kv_inputs[0].shape}, {len(kv_outputs)} present outputs"
            if facts.kv_cache and kv_inputs
            else ("yes" if facts.kv_cache else "no"),
        ),
        ("opset", f"{facts.opset} (IR {facts.ir_version}, by {facts.producer})"),
        ("size", size),
        ("surgery", "; ".join(_history_line(h) for h in facts.history) or "none"),
    ]
    for key, value in lines:
        out.print(f"[bold]{key:>9}[/]  {escape(value)}", highlight=False)
    table = Table(show_edge=False, pad_edge=False)
    for column in ("layer", "form", "ln", "mlp", "resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"):
        table.add_column(column, overflow="fold")
    for b in facts.blocks:
        table.add_row(
            str(b.layer), b.form, b.ln_kind, b.mlp_kind, b.resid_pre, b.attn_out, b.resid_mid or "-", b.mlp_out, b.resid_post
        )
    out.print(table)


@_command
def parallelize(
    model: Annotated[Path, typer.Argument(help="ONNX file or folder from `surgery export`.")],
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Where to write the rewritten model (folder in, folder out).")],
    layers: Annotated[str, typer.Option(help="Blocks to rewrite: `all`, or e.g. `3-7,12`, `-1`.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the changes as JSON.")] = False,
) -> None:
    """Rewrite sequential blocks into parallel form: resid_post = resid_pre + attn_out + mlp(ln2(resid_pre))."""
    from surgery.passes import parallelize as run

    _rewrite(model, out_path, layers, as_json, lambda m, chosen: run(m, chosen))


@_command
def ablate(
    model: Annotated[Path, typer.Argument(help="ONNX file or folder from `surgery export`.")],
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Where to write the rewritten model (folder in, folder out).")],
    branch: Annotated[str, typer.Option(help="`mlp` or `attn`: whose output the residual add receives in part.")] = "mlp",
    mode: Annotated[str, typer.Option(help="`tangential`, `radial`, `remove` or `scale` (with --scale).")] = "tangential",
    layers: Annotated[str, typer.Option(help="Blocks to rewrite: `all`, or e.g. `3-7,12`, `-1`.")] = "all",
    scale: Annotated[Optional[float], typer.Option(help="Factor for --mode scale.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the changes as JSON.")] = False,
) -> None:
    """Keep only the tangential or radial part of a branch's output, remove it, or scale it."""
    from surgery.passes import project

    _rewrite(model, out_path, layers, as_json, lambda m, chosen: project(m, branch, mode, chosen, scale))


def _rewrite(model_path: Path, out_path: Path, layers: str, as_json: bool, apply) -> None:
    from surgery import graph
    from surgery.blocks import find_blocks
    from surgery.layers import parse_layers

    model = graph.load(model_path)
    chosen = parse_layers(layers, len(find_blocks(model, where=str(model_path))))
    result = apply(model, chosen)
    written = graph.write(result.model, out_path, like=model_path)
    if as_json:
        changes = [{"layer": c.layer, "change": c.what, "applied": c.applied} for c in result.changes]
        print(json.dumps({"out": str(written), "changes": changes}, indent=2))
        return
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("layer", justify="right")
    table.add_column("change")
    for c in result.changes:
        table.add_row(str(c.layer), c.what if c.applied else f"[dim]{escape(c.what)}[/]")
    out.print(table)
    out.print(f"{len(result.changed_layers)} of {len(result.changes)} selected blocks changed -> {written}", highlight=False)


def _history_line(entry: dict) -> str:
    layers = entry.get("layers")
    options = {k: v for k, v in (entry.get("options") or {}).items() if v is not None}
    extra = " ".join(f"{k}={v}" for k, v in options.items())
    return f"{entry.get('pass', '?')} layers={layers} {extra}".strip()


if __name__ == "__main__":
    app()
