"""The package's shape: stages as sub-packages, each importing only from those below it (the import-linter contract in
pyproject.toml, which README's test command also runs, and no upward import hidden in a string), numbers apart from
their presentation, short modules and functions with few parameters, and docs/architecture.md naming every module."""

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
    statistics = copy / "surgery" / "measure" / "statistics.py"  # numbers formatting themselves: presentation's job
    statistics.write_text(statistics.read_text() + "\n\ndef _shown():\n    from surgery.report import numbers  # noqa: F401\n")
    broken = _lint(copy)
    assert broken.returncode != 0
    assert "surgery.files is not allowed to import surgery.jobs" in broken.stdout
    assert "surgery.files.graph -> surgery.jobs" in broken.stdout
    assert "surgery.measure is not allowed to import surgery.report" in broken.stdout
    assert "surgery.measure.statistics -> surgery.report.numbers" in broken.stdout


def _stages() -> list[str]:
    """The contract's layers, top to bottom, each a list of its stages' short names."""
    text = (ROOT / "pyproject.toml").read_text()
    layers = re.search(r"layers = \[(.*?)\]", text, flags=re.DOTALL).group(1)
    return [[s.strip().removeprefix("surgery.") for s in layer.split("|")] for layer in re.findall(r'"([^"]+)"', layers)]


def test_the_lowest_stages_name_no_higher_one_as_an_import_or_in_a_string():
    """files/ and model/ never name a module of a stage above them: not in an import, and not in a string that could be
    imported at run time (importlib), which neither the contract nor a picture of the imports would see."""
    layers = _stages()
    for low in ("files", "model"):
        below = next(i for i, layer in enumerate(layers) if low in layer)
        higher = [stage for layer in layers[:below] for stage in layer]
        pattern = re.compile(r"\bsurgery[./](" + "|".join(re.escape(s) for s in higher) + r")\b")
        for path in sorted((PACKAGE / low).rglob("*.py")):
            tree = ast.parse(path.read_text())
            names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
            names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            names += [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            found = [name for name in names if pattern.search(name)]
            assert not found, f"{path.relative_to(ROOT)} names a higher stage: {found}"


def test_statistics_return_numbers_and_presentation_formats_them():
    """No function of the statistics stage (surgery/measure) returns or builds display text: no __str__ / __format__,
    no `-> str`, no returned f-string; report/ formats its dataclasses."""
    for path in sorted((PACKAGE / "measure").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            where = f"{path.relative_to(ROOT)}:{node.name}"
            assert node.name not in ("__str__", "__format__", "__repr__"), where
            assert node.returns is None or "str" not in [t.strip() for t in ast.unparse(node.returns).split("|")], where
            returned = [r.value for r in ast.walk(node) if isinstance(r, ast.Return) and r.value is not None]
            assert not any(isinstance(v, ast.JoinedStr) or (isinstance(v, ast.Constant) and isinstance(v.value, str)) for v in returned), where


def test_no_module_over_500_lines_and_no_function_over_80_but_the_commands():
    long_modules = [f"{p.relative_to(ROOT)} ({n})" for p in sorted(PACKAGE.rglob("*.py")) if (n := len(p.read_text().splitlines())) > 500]
    assert not long_modules, long_modules
    long_functions = [f"{path}:{name} ({n})" for path, name, _, command, n in _functions(lengths=True) if n > 80 and not command]
    assert not long_functions, long_functions


def _functions(lengths: bool = False):
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)] + [a.arg for a in (args.vararg, args.kwarg) if a]
                commands = any(isinstance(d, ast.Call) and getattr(d.func, "id", "") == "_command" for d in node.decorator_list)
                found = (path.relative_to(ROOT), node.name, [n for n in names if n not in ("self", "cls")], commands)
                yield (*found, node.end_lineno - node.lineno + 1) if lengths else found


def test_settings_travel_whole_no_function_but_a_command_takes_more_than_ten_parameters():
    many = [f"{path}:{name} ({len(params)})" for path, name, params, command in _functions() if len(params) > 10 and not command]
    assert not many, many
    auto = next(params for path, name, params, _ in _functions() if name == "auto" and path.name == "job.py")
    assert len(auto) <= 6, auto


def test_the_top_level_holds_the_stages_of_the_contract_and_nothing_else():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    stages = {f"{stage}.py" if (PACKAGE / f"{stage}.py").exists() else stage for layer in _stages() for stage in layer}
    assert set(entries) == stages | {"__init__.py"}, set(entries) ^ (stages | {"__init__.py"})  # every entry a stage of the contract


def test_docs_architecture_names_every_module_that_exists_and_none_that_does_not():
    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = {str(p.relative_to(PACKAGE).with_suffix("")) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    named = set(re.findall(r"`surgery/([a-z_/]+)\.py`", text)) - {"__init__"}
    assert modules - named == set(), f"docs/architecture.md does not name {sorted(modules - named)}"
    assert named - modules == set(), f"docs/architecture.md names modules that do not exist: {sorted(named - modules)}"
