"""A rewritten graph keeps its input's interface exactly: the names, element types and declared dimensions (a name stays
a name, e.g. the GenAI builder's `kv_cache_dim`; a number stays a number) of every input and output, in order, and the
files beside the model (genai_config.json, tokenizer files, config.json) byte for byte; on every deployed format, after
every pass and after the main job."""

import onnx
import pytest
from typer.testing import CliRunner

from surgery.cli import app
from surgery.errors import SurgeryError
from surgery.files import graph
from surgery.model.subject import Subject
from surgery.passes import PASSES, ablate, compensate, fuse, parallelize
from tests.test_deployed import Builds

pytestmark = pytest.mark.xdist_group("deployed")
runner = CliRunner()
FORMATS = ("optimum", "dynamo", "genai-fp32", "genai-fp16", "genai-int4", "ortopt-llama", "ortopt-gpt2")
JOB = ["--seq-len", "32", "--fit-windows", "8", "--windows", "4", "--eval-windows", "2", "--no-latency", "--max-kl", "none",
       "--max-loss-increase", "1"]


@pytest.fixture(scope="module")
def builds(tmp_path_factory, tiny_export):
    return Builds(tmp_path_factory.mktemp("interface"), tiny_export)


def built(name, builds, tiny_export):
    """The fixture folder of format `name`, made once per module (Builds)."""
    if name == "optimum":
        return builds.optimum("llama")
    if name == "dynamo":
        pytest.importorskip("torch")
        return tiny_export("llama", exporter="dynamo", past=False, seed=5).onnx
    return builds.variant(name)


@pytest.fixture(scope="module", params=FORMATS)
def folder(request, builds, tiny_export):
    return built(request.param, builds, tiny_export)


def interface(path) -> dict:
    """What a server binds to: every input and output, in order, with its element type and declared dimensions."""
    model = onnx.load(str(graph.resolve(path)), load_external_data=False)

    def declared(value):
        t = value.type.tensor_type
        return value.name, t.elem_type, tuple(d.dim_param if d.HasField("dim_param") else d.dim_value if d.HasField("dim_value") else None
                                              for d in t.shape.dim)

    return {"inputs": [declared(v) for v in model.graph.input], "outputs": [declared(v) for v in model.graph.output]}


def beside(folder) -> dict[str, bytes]:
    """The files beside the model that a runtime reads (config, genai_config, tokenizer), by name."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
            if p.is_file() and p.suffix not in (".onnx", ".data") and not p.name.endswith((".onnx.data", ".onnx_data"))}


def assert_same_interface(src, out) -> None:
    assert interface(out) == interface(src)
    kept = beside(out)
    for name, data in beside(src).items():
        assert kept.get(name) == data, f"{name} changed"


def rewrites(subject: Subject) -> dict:
    """Each pass on every block it accepts (the pass contract's example arguments); a refused format is left out."""
    layers = range(subject.n_layers)
    fixes = PASSES["compensate"].example(subject, layers).fixes
    made = {"parallel": lambda: parallelize(subject, layers), "ablated": lambda: ablate(subject, "mlp", "tangential", layers),
            "compensated": lambda: compensate(subject, fixes), "fused": lambda: fuse(subject, layers)}
    out = {}
    for name, make in made.items():
        try:
            out[name] = make().model
        except SurgeryError as e:  # a format a pass refuses says so in one line (test_deployed: which, and why)
            assert "cannot" in str(e)
    return out


def test_every_pass_keeps_the_declared_interface_and_the_files_beside(folder, tmp_path):
    subject = Subject.load(folder)
    written = rewrites(subject)
    assert {"parallel", "ablated"} <= set(written)  # every format takes these two
    for name, model in written.items():
        assert_same_interface(folder, graph.write(model, tmp_path / name, like=folder).parent)


@pytest.mark.parametrize("name", [f if f == "genai-int4" else pytest.param(f, marks=pytest.mark.slow) for f in FORMATS])
def test_the_main_job_keeps_the_declared_interface_and_the_files_beside(name, builds, tiny_export, tmp_path):
    """Every format; the quick run keeps the GenAI int4 build (the one that declares `kv_cache_dim`), the rest are slow."""
    folder = built(name, builds, tiny_export)
    out = tmp_path / "auto"
    result = runner.invoke(app, ["parallelize", str(folder), "-o", str(out), *JOB])
    assert result.exit_code == 0, result.output
    assert_same_interface(folder, out)


def test_the_genai_builders_kv_cache_dim_stays_a_name(builds, tmp_path):
    folder = builds.variant("genai-int4")
    past = [dims for name, _, dims in interface(folder)["inputs"] if name.startswith("past_key_values")]
    assert past and all(dims[3] == "kv_cache_dim" for dims in past)  # what the builder declares, and what is kept
    out = graph.write(parallelize(Subject.load(folder), [0]).model, tmp_path / "one", like=folder)
    assert [dims for name, _, dims in interface(out)["inputs"] if name.startswith("past_key_values")] == past
    loaded = [v.shape[3] for v in Subject.load(out.parent).model.graph.inputs if v.name.startswith("past_key_values")]
    assert all(isinstance(size, int) and size > 0 for size in loaded)  # in memory the config's size: an empty cache can be fed
