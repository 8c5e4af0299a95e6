import hashlib
import random
import shutil

import onnx
import onnx_ir as ir
import pytest
from typer.testing import CliRunner

from surgery.cli import app

runner = CliRunner()


def _with_external_data(fixture_path, folder):
    """tiny-llama saved into `folder` as model.onnx + weights.bin, with its config and tokenizer beside it."""
    src = fixture_path("llama")
    folder.mkdir()
    for item in src.iterdir():
        if item.name != "model.onnx":
            shutil.copy2(item, folder / item.name)
    ir.save(ir.load(src / "model.onnx"), folder / "model.onnx", external_data="weights.bin")
    return folder


def _edit(file, edit):
    """Apply `edit` to the ModelProto in `file` (its external data left where it is) and save it back."""
    proto = onnx.load(str(file), load_external_data=False)
    edit(proto)
    onnx.save(proto, str(file))


def _set_location(location):
    def edit(proto):
        tensor = next(t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
        next(e for e in tensor.external_data if e.key == "location").value = location

    return edit


def _secret(tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(bytes(1 << 20))
    return secret


def _parent_location(tmp_path, model):
    _secret(tmp_path)
    _edit(model / "model.onnx", _set_location("../secret.bin"))
    return model, "outside the model's folder"


def _absolute_location(tmp_path, model):
    _edit(model / "model.onnx", _set_location(str(_secret(tmp_path))))
    return model, "absolute path"


def _symlink_out(tmp_path, model):
    (model / "link.bin").symlink_to(_secret(tmp_path))
    _edit(model / "model.onnx", _set_location("link.bin"))
    return model, "a link to"


def _truncated_data(tmp_path, model):
    weights = model / "weights.bin"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return model, "cut short"


def _empty_file(tmp_path, model):
    (model / "model.onnx").write_bytes(b"")
    return model / "model.onnx", "is empty"


def _text_file(tmp_path, model):
    (model / "model.onnx").write_text("this is not a model\n")
    return model / "model.onnx", "as an ONNX model"


def _used_before_made(tmp_path, model):
    def edit(proto):
        nodes = list(proto.graph.node)
        made = {o: i for i, n in enumerate(nodes) for o in n.output}
        late = next(i for i, n in enumerate(nodes) if any(made.get(x, i) == i - 1 for x in n.input))  # reads the node before it
        nodes[late - 1], nodes[late] = nodes[late], nodes[late - 1]
        del proto.graph.node[:]
        proto.graph.node.extend(nodes)

    _edit(model / "model.onnx", edit)
    return model, "before node"


def _dangling_input(tmp_path, model):
    def edit(proto):
        node = next(n for n in proto.graph.node if n.op_type == "MatMul")
        node.input[0] = "nobody/makes/this"

    _edit(model / "model.onnx", edit)
    return model, "'nobody/makes/this', which is neither a graph input, an initializer nor an output of an earlier node"


CASES = {
    "parent location": _parent_location,
    "absolute location": _absolute_location,
    "symlink out of the folder": _symlink_out,
    "truncated external data": _truncated_data,
    "empty file": _empty_file,
    "text file": _text_file,
    "value used before it is made": _used_before_made,
    "dangling node input": _dangling_input,
}


def _files(folder):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def _refused(result, message):
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
    assert message in result.stderr, result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("case", CASES)
def test_a_bad_model_is_refused_on_load_and_nothing_is_written(tmp_path, fixture_path, case):
    model, message = CASES[case](tmp_path, _with_external_data(fixture_path, tmp_path / "model"))
    before = _files(tmp_path)
    out = tmp_path / "out"
    _refused(runner.invoke(app, ["parallelize", str(model), "--layers", "0", "-o", str(out)]), message)
    _refused(runner.invoke(app, ["inspect", str(model)]), message)
    assert not out.exists()
    assert _files(tmp_path) == before


def test_a_model_with_its_external_data_in_its_folder_loads_and_rewrites(tmp_path, fixture_path):
    model = _with_external_data(fixture_path, tmp_path / "model")
    before = _files(model)
    result = runner.invoke(app, ["inspect", str(model)])
    assert result.exit_code == 0, result.output
    assert "3 sequential" in result.stdout and "weights.bin" in result.stdout
    out = tmp_path / "out"
    result = runner.invoke(app, ["parallelize", str(model), "--layers", "0", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["inspect", str(out)]).exit_code == 0
    assert _files(model) == before


def test_a_data_file_linked_from_inside_the_folder_loads(tmp_path, fixture_path):
    model = _with_external_data(fixture_path, tmp_path / "model")
    (model / "weights.bin").rename(model / "real.bin")
    (model / "weights.bin").symlink_to("real.bin")
    result = runner.invoke(app, ["inspect", str(model)])
    assert result.exit_code == 0, result.output


def test_flipped_bytes_never_end_in_a_traceback(tmp_path, fixture_path):
    """200 copies of tiny-llama's model.onnx with 8 random bits flipped each: inspect and a plain parallelize
    either work or say what is wrong in one line."""
    original = (fixture_path("llama") / "model.onnx").read_bytes()
    rng = random.Random(0)
    refused = 0
    for i in range(200):
        data = bytearray(original)
        for _ in range(8):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        model, out = tmp_path / f"{i}.onnx", tmp_path / f"{i}-out.onnx"
        model.write_bytes(data)
        for args in (["inspect", str(model)], ["parallelize", str(model), "--layers", "0", "-o", str(out)]):
            result = runner.invoke(app, args)
            assert result.exception is None or isinstance(result.exception, SystemExit), (i, args[0], repr(result.exception))
            assert result.exit_code in (0, 1), (i, args[0], result.output)
            if result.exit_code == 1:
                assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, (i, result.stderr)
                refused += 1
        assert model.read_bytes() == data
        assert out.exists() == (result.exit_code == 0)
        model.unlink()
        out.unlink(missing_ok=True)
    assert 0 < refused < 400  # the mutations hit both what is refused and what still works


@pytest.mark.parametrize(
    "command",
    [
        ["ablate", "{model}", "--mode", "remove", "-o", "{out}"],
        ["evaluate", "{model}", "{model}", "--seq-len", "16", "--max-windows", "1", "--no-latency", "--device", "cpu"],
        ["diagnose", "{model}", "--only", "defect", "--seq-len", "16", "--windows", "1", "--eval-windows", "1", "--device", "cpu", "-o", "{out}"],
    ],
    ids=lambda c: c[0],
)
def test_every_command_checks_the_model_before_any_work(tmp_path, fixture_path, command):
    model, message = _dangling_input(tmp_path, _with_external_data(fixture_path, tmp_path / "model"))
    before = _files(tmp_path)
    out = tmp_path / "out"
    _refused(runner.invoke(app, [a.format(model=model, out=out) for a in command]), message)
    assert not out.exists()
    assert _files(tmp_path) == before


def test_a_session_opened_from_a_path_checks_the_model_first(tmp_path, fixture_path):
    from surgery.engine import runtime
    from surgery.errors import SurgeryError

    model, _ = _truncated_data(tmp_path, _with_external_data(fixture_path, tmp_path / "model"))
    with pytest.raises(SurgeryError, match="cut short"):
        runtime.session(model / "model.onnx")
