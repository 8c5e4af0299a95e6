import json

import pytest
from typer.testing import CliRunner

from surgery.cli import app
from tests.helpers import linear_model

runner = CliRunner()


def test_inspect_shows_every_block_and_the_kv_cache(fixture_path):
    result = runner.invoke(app, ["inspect", str(fixture_path("llama"))])
    assert result.exit_code == 0, result.output
    assert "3 sequential" in result.stdout
    assert "KV cache  yes: 6 past inputs" in result.stdout
    assert "RMSNorm (decomposed)" in result.stdout


def test_inspect_json_is_the_block_map(fixture_path):
    result = runner.invoke(app, ["inspect", str(fixture_path("gpt_neox_parallel")), "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert facts["n_layers"] == 3 and facts["form"] == "parallel" and facts["kv_cache"] is True
    assert facts["d_model"] == 64 and facts["vocab"] == 512
    assert [b["resid_mid"] for b in facts["blocks"]] == [None, None, None]
    assert [b["form"] for b in facts["blocks"]] == ["parallel"] * 3


def _bad_inputs(tmp_path, fixture_path):
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n")
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes((fixture_path("llama") / "model.onnx").read_bytes()[:5000])
    no_blocks = tmp_path / "linear.onnx"
    import onnx_ir as ir

    ir.save(linear_model(), no_blocks)
    return {
        "text": (text, "cannot read"),
        "truncated": (truncated, "cannot read"),
        "no blocks": (no_blocks, "found no transformer blocks"),
        "missing": (tmp_path / "nowhere.onnx", "does not exist"),
        "empty folder": (tmp_path, "found no .onnx file"),
    }


@pytest.mark.parametrize("case", ["text", "truncated", "no blocks", "missing", "empty folder"])
def test_inspect_bad_input_is_one_line_and_exit_1(tmp_path, fixture_path, case):
    (tmp_path / "in").mkdir()
    path, message = _bad_inputs(tmp_path / "in", fixture_path)[case]
    if case == "empty folder":
        path = tmp_path / "empty"
        path.mkdir()
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output and result.stdout == ""


def _sha(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_parallelize_folder_in_gives_folder_out(tmp_path, fixture_path):
    src = fixture_path("llama")
    before = {p.name: _sha(p) for p in src.iterdir()}
    out = tmp_path / "par"
    result = runner.invoke(app, ["parallelize", str(src), "--layers", "0,-1", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(c["layer"], c["applied"]) for c in report["changes"]] == [(0, True), (2, True)]
    assert {p.name for p in out.iterdir()} == set(before)  # model.onnx + config + tokenizer files
    assert _sha(out / "tokenizer.json") == before["tokenizer.json"]
    assert {p.name: _sha(p) for p in src.iterdir()} == before  # input untouched

    facts = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)
    assert [b["form"] for b in facts["blocks"]] == ["parallel", "sequential", "parallel"]
    assert facts["history"][0]["pass"] == "parallelize" and facts["history"][0]["layers"] == [0, 2]
    shown = runner.invoke(app, ["inspect", str(out)]).stdout
    assert "parallelize layers=[0, 2]" in shown


def test_ablate_file_in_gives_file_out(tmp_path, fixture_path):
    src = fixture_path("gpt2") / "model.onnx"
    out = tmp_path / "ablated.onnx"
    result = runner.invoke(app, ["ablate", str(src), "--branch", "attn", "--mode", "scale", "--scale", "0.5", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "attn scale=0.5" in result.stdout and "3 of 3 selected blocks changed" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ablated.onnx"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["parallelize", "{src}", "--layers", "all", "-o", "{src}"], "would overwrite the input"),
        (["parallelize", "{src}", "--layers", "7", "-o", "{out}"], "layer 7 in --layers '7' is out of range"),
        (["parallelize", "{src}", "--layers", "first", "-o", "{out}"], "cannot read --layers 'first'"),
        (["ablate", "{src}", "--mode", "scale", "-o", "{out}"], "needs a factor; add --scale"),
        (["ablate", "{src}", "--mode", "sideways", "-o", "{out}"], "unknown mode 'sideways'"),
    ],
)
def test_rewrite_errors_write_nothing(tmp_path, fixture_path, args, message):
    src = fixture_path("llama")
    out = tmp_path / "out"
    result = runner.invoke(app, [a.format(src=src, out=out) for a in args])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args,message",
    [
        (["evaluate", "{src}", "--max-windows", "0"], "--max-windows 0: give a whole number of at least 1, or `all`"),
        (["evaluate", "{src}", "--max-windows", "-3"], "--max-windows -3"),
        (["evaluate", "{src}", "--max-windows", "many"], "--max-windows many"),
        (["evaluate", "{src}", "--batch-size", "0"], "--batch-size 0: give a whole number of at least 1"),
        (["evaluate", "{src}", "--repeats", "0"], "--repeats 0"),
        (["evaluate", "{src}", "--stride", "0"], "--stride 0"),
        (["parallelize", "{src}", "-o", "{out}", "--eval-windows", "0"], "--eval-windows 0"),
        (["parallelize", "{src}", "-o", "{out}", "--windows", "0"], "--windows 0"),
        (["parallelize", "{src}", "-o", "{out}", "--fit-windows", "-1"], "--fit-windows -1"),
        (["parallelize", "{src}", "-o", "{out}", "--protect-first", "-2"], "--protect-first -2: give a whole number of at least 0"),
        (["diagnose", "{src}", "-o", "{out}", "--critical-seeds", "0"], "--critical-seeds 0"),
    ],
)
def test_counts_below_their_least_are_one_line_before_any_work(tmp_path, fixture_path, args, message):
    """Window, repeat and batch counts of zero or less: one line and exit 1 (they used to end in ZeroDivisionError,
    ValueError or IndexError tracebacks after loading the model), nothing written."""
    out = tmp_path / "out"
    result = runner.invoke(app, [a.format(src=fixture_path("llama"), out=out) for a in args])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""
    assert not out.exists()


def test_evaluate_scores_every_window_of_the_part_with_max_windows_all(fixture_path):
    from surgery.text import data

    result = runner.invoke(app, ["evaluate", str(fixture_path("llama")), "--max-windows", "all", "--seq-len", "32", "--no-latency", "--json"])
    assert result.exit_code == 0, result.output
    every = data.windows(fixture_path("llama"), seq_len=32, part="evaluation")
    assert json.loads(result.stdout)["windows"]["count"] == len(every) > 16


def _commands():
    import typer

    return typer.main.get_command(app).commands


def _count_options():
    """(command, --flag, least) of every AtLeast option, read from the commands themselves."""
    from surgery.cli import counts

    return [(name, flag, least) for name, command in sorted(_commands().items()) for flag, least in counts(command.callback).values()]


def test_the_count_options_are_found_where_they_are_declared():
    found = {(name, flag) for name, flag, _ in _count_options()}
    assert {("parallelize", "--fit-windows"), ("parallelize", "--patience"), ("evaluate", "--warmup"), ("export", "--opset"),
            ("evaluate", "--limit"), ("parallelize", "--task-limit"), ("parallelize", "--frontier-every"), ("parallelize", "--frontier-point")} <= found
    assert len(found) == 27


@pytest.mark.parametrize("name,flag,least", _count_options())
def test_each_count_option_below_its_least_is_one_line_and_exit_1(tmp_path, fixture_path, name, flag, least):
    """A new count option is covered here by declaring its AtLeast; the check runs before any work."""
    out = tmp_path / "out"
    command = _commands()[name]
    args = [name, "smollm2-135m" if name == "export" else str(fixture_path("llama"))]
    args += ["-o", str(out)] if any("--out" in p.opts for p in command.params) else []
    result = runner.invoke(app, [*args, flag, str(least - 1)])
    assert result.exit_code == 1, result.output
    assert result.stderr == f"error: {flag} {least - 1}: give a whole number of at least {least}\n"
    assert result.stdout == "" and not out.exists()


@pytest.mark.parametrize("name", sorted(_commands()))
def test_each_command_shows_an_example_its_own_options_read(name):
    import shlex

    command = _commands()[name]
    example = command.epilog.removeprefix("Example: ")
    words = shlex.split(example)
    assert words[:2] == ["surgery", name]
    command.make_context(name, words[2:])  # unknown options, or values of the wrong type, raise here
    result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and example in result.stdout


@pytest.mark.parametrize("name", ["inspect", "ablate"])
def test_the_quick_examples_run_on_a_tiny_model(tmp_path, fixture_path, name):
    """`out/smollm2` is the README's export; the tiny llama stands in for it."""
    import shlex

    words = shlex.split(_commands()[name].epilog.removeprefix("Example: "))[1:]
    args = [str(fixture_path("llama")) if w == "out/smollm2" else str(tmp_path / w) if w.startswith("out/") else w for w in words]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""


def test_verbose_reaches_the_command_through_typer_s_context(monkeypatch, tmp_path):
    """`surgery --verbose export ...` lets the exporters' progress through to stderr; without it they are silenced."""
    import surgery.files.export
    from surgery.errors import SurgeryError

    def fake_export(source, out_dir, **options):
        print("exporter progress")
        raise SurgeryError("stop here")

    monkeypatch.setattr(surgery.files.export, "export", fake_export)
    quiet = runner.invoke(app, ["export", "smollm2-135m", "-o", str(tmp_path / "x")])
    loud = runner.invoke(app, ["--verbose", "export", "smollm2-135m", "-o", str(tmp_path / "x")])
    assert quiet.exit_code == loud.exit_code == 1
    assert "exporter progress" not in quiet.output
    assert "exporter progress" in loud.stderr and loud.stdout == ""
