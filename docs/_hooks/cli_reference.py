"""MkDocs hook: `<!-- cli: COMMAND -->` in a page becomes that command's usage, summary and options, read from the
typer app's click command objects at build time (offline), so docs/commands.md cannot fall behind `--help`."""

from __future__ import annotations

import re

MARKER = re.compile(r"^<!-- cli: ([a-z-]+) -->$", re.MULTILINE)


def _cell(text: str) -> str:
    """One markdown table cell: pipes escaped, rich's `\\[` unescaped, on one line."""
    return " ".join(text.replace("\\[", "[").replace("|", "\\|").split())


def reference(name: str) -> str:
    import typer.main

    from surgery.cli import app

    group = typer.main.get_command(app)
    command = group.commands.get(name)
    if command is None:
        raise ValueError(f"docs: no command {name!r} in surgery.cli; commands: {', '.join(group.commands)}")
    ctx = command.make_context(name, [], resilient_parsing=True)  # no parsing: required arguments may be missing
    usage = command.get_usage(ctx).replace("Usage: ", "surgery ", 1)
    lines = ["```text", usage, "```", "", " ".join((command.help or "").split()), ""]
    panels: dict[str, list[tuple[str, str]]] = {}
    for param in command.params:
        record = param.get_help_record(ctx)
        if record is None:
            continue
        panel = getattr(param, "rich_help_panel", None) or ("Arguments" if param.param_type_name == "argument" else "Options")
        panels.setdefault(panel, []).append(record)
    for panel, records in panels.items():
        lines += [f"**{panel}**", "", "| option | what it does |", "|---|---|"]
        lines += [f"| `{_cell(opts)}` | {_cell(text)} |" for opts, text in records]
        lines.append("")
    return "\n".join(lines)


def on_page_markdown(markdown: str, **kwargs) -> str:
    return MARKER.sub(lambda m: reference(m.group(1)), markdown)
