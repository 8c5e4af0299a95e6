"""The package's shape: stages as sub-packages, each importing only from those below it (the import-linter contract in
pyproject.toml, which README's test command also runs), few parameters per function, and docs/architecture.md naming
every module."""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "surgery"
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    """import-linter's contracts of pyproject.toml, on the package under `root`."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], capture_output=True, text=True, cwd=root, env=env)


@pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[test]')")
def test_each_stage_imports_only_from_the_stages_below_it_and_a_wrong_import_fails_the_contract(tmp_path):
    kept = _lint(ROOT)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "stages KEPT" in kept.stdout
    # the same package with one import from a lower stage up into a higher one: the contract names it
    copy = tmp_path / "repo"
    shutil.copytree(PACKAGE, copy / "surgery", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    graph = copy / "surgery" / "files" / "graph.py"
    graph.write_text(graph.read_text() + "\n\ndef _upward():\n    from surgery.jobs import job  # noqa: F401\n")
    broken = _lint(copy)
    assert broken.returncode != 0
    assert "surgery.files is not allowed to import surgery.jobs" in broken.stdout
    assert "surgery.files.graph -> surgery.jobs" in broken.stdout


def _functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)] + [a.arg for a in (args.vararg, args.kwarg) if a]
                commands = any(isinstance(d, ast.Call) and getattr(d.func, "id", "") == "_command" for d in node.decorator_list)
                yield path.relative_to(ROOT), node.name, [n for n in names if n not in ("self", "cls")], commands


def test_settings_travel_whole_no_function_but_a_command_takes_more_than_ten_parameters():
    many = [f"{path}:{name} ({len(params)})" for path, name, params, command in _functions() if len(params) > 10 and not command]
    assert not many, many
    auto = next(params for path, name, params, _ in _functions() if name == "auto" and path.name == "job.py")
    assert len(auto) <= 6, auto


def test_the_top_level_holds_the_stages_and_few_modules():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 12, entries
    stages = {"cli.py", "report", "jobs", "diagnostics", "compensation", "analysis", "measure", "passes", "model", "files", "errors.py"}
    assert stages <= set(entries), stages - set(entries)


def test_docs_architecture_names_every_module_that_exists_and_none_that_does_not():
    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = {str(p.relative_to(PACKAGE).with_suffix("")) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    named = set(re.findall(r"`surgery/([a-z_/]+)\.py`", text)) - {"__init__"}
    assert modules - named == set(), f"docs/architecture.md does not name {sorted(modules - named)}"
    assert named - modules == set(), f"docs/architecture.md names modules that do not exist: {sorted(named - modules)}"
