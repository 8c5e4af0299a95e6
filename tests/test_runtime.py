"""runtime: the IO-binding path (bound on CPU host buffers here, on the device under CUDA), where ORT placed each node
(a mocked CUDA profile, real CPU ones), and the CUDA benchmark's refusal and smoke run."""

import collections
import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import onnx_ir as ir
import pytest

from surgery.engine import runtime
from surgery.engine.cluster import Resources
from surgery.files import graph
from surgery.jobs import evaluate
from surgery.jobs.select import SelectionSettings
from surgery.measure import scoring, statistics, timing
from surgery.measure.timing import LatencySettings
from surgery.text.data import DataSettings
from tests.conftest import ROOT


@pytest.fixture
def llama(fixture_path):
    sess = runtime.session(fixture_path("llama"), runtime.Options(device="cpu"))
    return sess, np.random.default_rng(0).integers(0, 512, size=(2, 17))


def test_a_bound_prefill_gives_what_sess_run_gives(llama):
    sess, ids = llama
    inputs = runtime.feeds(sess, ids[:, :16])
    run = runtime.Prepared(sess, inputs, bind=True)
    assert run.binding is not None and runtime.Prepared(sess, inputs).binding is None  # CPU binds only when asked
    run()
    outputs = run.outputs()
    assert all(v.device_name() == "cpu" for v in outputs)
    for expected, got in zip(sess.run(None, inputs), outputs, strict=True):
        np.testing.assert_array_equal(got.numpy(), expected)


def test_a_bound_decode_reads_the_bound_prefills_present_as_its_past(llama):
    sess, ids = llama
    inputs = runtime.feeds(sess, ids[:, :16])
    prefill = runtime.Prepared(sess, inputs, bind=True)
    prefill()
    decode = runtime.Prepared(sess, runtime.decode_inputs(prefill, ids[:, 16:]), bind=True)
    assert decode.inputs["past_key_values.0.key"].shape() == [2, 2, 16, 16] and (decode.inputs["position_ids"].numpy() == 16).all()
    inputs["input_ids"][:] = 0  # the bound CPU input reads this buffer: the next prefill computes another present,
    prefill()  # in its old output buffers, so a past handed over from them would change under the decode
    decode()
    past = runtime.present_as_past(sess, sess.run(None, runtime.feeds(sess, ids[:, :16])))
    for expected, got in zip(sess.run(None, runtime.feeds(sess, ids[:, 16:], past)), decode.outputs(), strict=True):
        np.testing.assert_array_equal(got.numpy(), expected)


def test_a_run_with_a_graph_id_writes_every_call_to_buffers_allocated_once_and_hands_them_over_on_keep(llama):
    """The fixed-buffer path a CUDA graph needs, on CPU (the id is ignored there): same outputs as sess.run, the same
    output addresses call after call; kept outputs leave with their values and the next call writes new buffers."""
    sess, ids = llama
    inputs = runtime.feeds(sess, ids[:, :16])
    expected = sess.run(None, inputs)
    prefill = runtime.Prepared(sess, inputs, graph=1)  # binds on CPU too: a graph needs bound buffers
    assert prefill.binding is not None and prefill.run_options.get_run_config_entry("gpu_graph_id") == "1"
    first = [v.numpy() for v in prefill.outputs()]  # the run made outside any graph to learn the shapes
    addresses = [v.data_ptr() for v in prefill.binding.get_outputs()]
    for _ in range(2):
        prefill()
        assert [v.data_ptr() for v in prefill.outputs()] == addresses
    for want, a, b in zip(expected, first, prefill.outputs(), strict=True):
        np.testing.assert_array_equal(a, want)
        np.testing.assert_array_equal(b.numpy(), want)
    decode = runtime.Prepared(sess, runtime.decode_inputs(prefill, ids[:, 16:]), graph=2)
    kept = decode.inputs["past_key_values.0.key"]
    assert kept.data_ptr() in addresses
    prefill()
    assert not {v.data_ptr() for v in prefill.outputs()} & set(addresses)  # the handed-over buffers are the decode's now
    decode()
    past = runtime.present_as_past(sess, expected)
    for want, got in zip(sess.run(None, runtime.feeds(sess, ids[:, 16:], past)), decode.outputs(), strict=True):
        np.testing.assert_array_equal(got.numpy(), want)


def test_a_cuda_graph_is_asked_of_the_cuda_provider_alone(monkeypatch, fixture_path):
    asked = []
    monkeypatch.setattr(runtime, "cuda_usable", lambda: True)
    monkeypatch.setattr(runtime.ort, "InferenceSession", lambda source, so, providers: asked.append(providers))
    for device in ("cuda", "cpu"):
        runtime.session(fixture_path("llama"), runtime.Options(device=device, cuda_graph=True))
    assert asked == [[(runtime.CUDA, {"enable_cuda_graph": "1"}), runtime.CPU], [runtime.CPU]]


def test_latency_on_fixed_buffers_times_the_same_runs(llama):
    sess, _ = llama
    (timed,) = timing.latency([sess], batch=2, seq_len=8, repeats=2, warmup=1, graphs=True)
    assert timed.decode_ms > 0 and timed.prefill_ms > 0 and timed.repeats == 2


def test_an_unbound_decode_step_matches_the_bound_one(llama):
    sess, ids = llama
    steps = []
    for bind in (False, True):
        prefill = runtime.Prepared(sess, runtime.feeds(sess, ids[:, :16]), bind=bind)
        prefill()
        steps.append(runtime.Prepared(sess, runtime.decode_inputs(prefill, ids[:, 16:]), bind=bind))
        steps[-1]()
    plain, bound = (s.outputs()[0] for s in steps)
    np.testing.assert_array_equal(bound.numpy(), plain)


@pytest.mark.skipif(runtime.cuda_usable(), reason="this machine has a usable CUDA provider")
def test_the_cuda_benchmark_says_in_one_line_that_it_needs_a_gpu():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda.py")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and "needs an NVIDIA GPU" in done.stderr


def test_two_onnxruntime_builds_get_one_warning_line(monkeypatch, fixture_path):
    import importlib.metadata
    import types

    from typer.testing import CliRunner

    from surgery.cli import app
    from tests.helpers import said

    def installed(*names):
        return lambda: [types.SimpleNamespace(metadata={"Name": n}) for n in names]

    monkeypatch.setattr(importlib.metadata, "distributions", installed("numpy", "onnxruntime-gpu"))
    assert runtime.clashing_builds() is None
    monkeypatch.setattr(importlib.metadata, "distributions", installed("onnxruntime-gpu", "onnxruntime", "numpy"))
    clash = runtime.clashing_builds()
    assert "onnxruntime and onnxruntime-gpu" in clash and "pip install onnxruntime-gpu`" in clash
    result = CliRunner().invoke(app, ["evaluate", str(fixture_path("llama")), "--max-windows", "1", "--seq-len", "16", "--no-latency"])
    assert result.exit_code == 0 and said(result.stderr) == [f"warning: {clash}"]


def _kernel(node: str, op: str, provider: str, dur: int = 10) -> dict:
    """One "Node" event of ORT's profile, as ORT writes it (sequential_executor.cc: "<node>_kernel_time", args op_name, provider)."""
    return {"cat": "Node", "name": f"{node}_kernel_time", "dur": dur, "args": {"op_name": op, "provider": provider}}


def test_a_cuda_profile_lists_the_ops_ort_placed_on_the_cpu_with_their_counts():
    run = (
        [_kernel(f"attn.{l}", "GroupQueryAttention", runtime.CPU) for l in range(4)]
        + [_kernel(f"shape.{i}", "Shape", runtime.CPU) for i in range(2)]
        + [_kernel(f"mm.{i}", "MatMul", runtime.CUDA) for i in range(8)]
        + [_kernel("copy", "MemcpyToHost", runtime.CUDA)]
    )
    noise = [{"cat": "Session", "name": "model_run", "dur": 99, "args": {}},
             {"cat": "Node", "name": "attn.0_fence_before", "dur": 0, "args": {"op_name": "GroupQueryAttention"}}]
    placed = runtime.placement_of(noise + run + run, runtime.CUDA)  # two runs: each node counts once
    assert placed == runtime.Placement(runtime.CUDA, 15, (("GroupQueryAttention", 4), ("Shape", 2)))
    assert str(placed) == "CUDA (CPU: GroupQueryAttention x4, Shape x2)"
    on_cuda = runtime.placement_of([e for e in run if e["args"]["provider"] == runtime.CUDA], runtime.CUDA)
    assert str(on_cuda) == "CUDA" and on_cuda.nodes == 9 and on_cuda.on_cpu == ()
    assert str(runtime.placement_of(run, runtime.CPU)) == "CPU"  # a CPU session has nothing to fall back from


def _small_graph() -> ir.Model:
    """x [2, 8] -> MatMul, Add, Relu, Transpose, Softmax -> y: no Constant or Cast nodes, which ORT turns
    into initializers or drops however it is set."""
    rng = np.random.default_rng(0)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 8]))
    w = ir.Value(name="w", const_value=ir.tensor(rng.standard_normal((8, 8)).astype(np.float32), name="w"))
    b = ir.Value(name="b", const_value=ir.tensor(rng.standard_normal(8).astype(np.float32), name="b"))
    nodes = [ir.node("MatMul", [x, w])]
    nodes.append(ir.node("Add", [nodes[-1].outputs[0], b]))
    nodes.append(ir.node("Relu", [nodes[-1].outputs[0]]))
    nodes.append(ir.node("Add", [nodes[-1].outputs[0], nodes[0].outputs[0]]))
    nodes.append(ir.node("Transpose", [nodes[-1].outputs[0]], attributes={"perm": [1, 0]}))
    nodes.append(ir.node("Softmax", [nodes[-1].outputs[0]], attributes={"axis": -1}))
    for i, node in enumerate(nodes):
        node.name = node.outputs[0].name = f"n{i}"
    nodes[-1].outputs[0].name, nodes[-1].outputs[0].dtype, nodes[-1].outputs[0].shape = "y", ir.DataType.FLOAT, ir.Shape([8, 2])
    g = ir.Graph([x], [nodes[-1].outputs[0]], nodes=nodes, initializers=[w, b], opset_imports={"": 17})
    return ir.Model(g, ir_version=8)


def _cpu_ops(sess) -> dict[str, int]:
    """Op counts of every node a profiled CPU session ran: read as if it were meant for CUDA, each is a CPU fallback."""
    placed = runtime.placement_of(runtime.profile_events(sess), runtime.CUDA)
    assert sum(n for _, n in placed.on_cpu) == placed.nodes  # every node ran on CPUExecutionProvider
    return dict(placed.on_cpu)


def test_a_real_cpu_profile_places_every_node_of_the_graph_on_the_cpu(tmp_path):
    model = _small_graph()
    sess = runtime.session(model, runtime.Options(device="cpu", optimization="disable", profile=str(tmp_path / "p")))
    sess.run(None, {"x": np.ones((2, 8), np.float32)})
    sess.run(None, {"x": np.ones((2, 8), np.float32)})
    assert _cpu_ops(sess) == dict(collections.Counter(n.op_type for n in model.graph))  # {"Add": 2, "MatMul": 1, ...}
    assert runtime.placement(sess) is None  # its profile has ended


def test_a_real_cpu_profile_counts_the_nodes_of_the_graph_ort_optimized(tmp_path, fixture_path):
    """At level `all` ORT fuses (SimplifiedLayerNormalization, FusedMatMul, ...): the placement has the nodes that
    ran, the ones of the optimized graph ORT writes out, not the exported graph's."""
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level, so.optimized_model_filepath = runtime.OPTIMIZATION["all"], str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(fixture_path("llama") / "model.onnx"), so, providers=[runtime.CPU])
    optimized = collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)
    sess = runtime.session(fixture_path("llama"), runtime.Options(device="cpu", optimization="all", profile=str(tmp_path / "p")))
    sess.run(None, runtime.feeds(sess, np.zeros((1, 8), np.int64)))
    ops = _cpu_ops(sess)
    assert ops == dict(optimized) and "SimplifiedLayerNormalization" in ops
    exported = collections.Counter(n.op_type for n in graph.load(fixture_path("llama")).graph)
    assert ops != dict(exported)


def test_latency_reads_each_sessions_placement_from_its_warm_up(fixture_path, tmp_path):
    handed = runtime.session(fixture_path("gpt2"), runtime.Options(device="cpu"))  # made without a profile
    profiled = runtime.session(fixture_path("gpt2"), runtime.Options(device="cpu", profile=str(tmp_path / "p")))
    made, plain, given = timing.latency([fixture_path("llama"), handed, profiled], seq_len=16, repeats=2, warmup=0)
    assert made.placement.provider == runtime.CPU and made.placement.nodes > 100 and str(made.placement) == "CPU"
    assert plain.placement is None and given.placement.nodes > 100
    assert runtime.placement(profiled) is None  # latency ended its profile before the timed runs
    first, second = evaluate.rows(["a", "b"], ["a", "b"], [_score()] * 2, [made, plain])
    assert first["placement"] == "CPU" and first["on_cpu"] == {} and first["provider"] == runtime.CPU
    assert second["placement"] == "CPU" and second["on_cpu"] is None  # the provider alone, where no profile says more


def _score():
    return statistics.Perplexity(1.0, math.e, 4, 2, 0.1, (2.0, 2.0), (2, 2), (0.0, 0.0), (2, 2), (0.0,) * 4)


def _cuda_latency():
    placed = runtime.Placement(runtime.CUDA, 120, (("GroupQueryAttention", 4), ("Shape", 2)))
    return timing.Latency(2.0, 2.5, 0.5, 0.6, 1, 16, 2, runtime.CUDA, placed)


def test_evaluate_shows_a_cuda_session_with_the_ops_it_left_on_the_cpu(monkeypatch, fixture_path):
    from typer.testing import CliRunner

    from surgery.cli import app

    monkeypatch.setattr(timing, "latency", lambda models, **kwargs: [_cuda_latency() for _ in models])
    args = ["evaluate", str(fixture_path("llama")), "--max-windows", "1", "--seq-len", "16", "--repeats", "2"]
    result = CliRunner().invoke(app, args + ["--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["models"]
    assert row["placement"] == "CUDA (CPU: GroupQueryAttention x4, Shape x2)" and row["on_cpu"] == {"GroupQueryAttention": 4, "Shape": 2}
    assert row["provider"] == runtime.CUDA
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0 and "CUDA (CPU: GroupQueryAttention x4, Shape x2)" in table.stdout


@pytest.fixture
def cuda_asked(monkeypatch):
    """A machine whose CUDA is usable, as far as surgery can tell; sessions record the providers asked for, then run on the CPU."""
    asked = []
    real = runtime.session

    def session(model, options=runtime.Options()):
        asked.append(runtime.providers(options.device))
        return real(model, dataclasses.replace(options, device="cpu"))

    monkeypatch.setattr(runtime, "cuda_usable", lambda: True)
    monkeypatch.setattr(runtime, "session", session)
    return asked


def test_the_speedup_estimate_is_profiled_where_the_latency_runs(cuda_asked, fixture_path):
    model = graph.load(fixture_path("llama"))
    times = timing.branch_times(model, seq_len=16, runs=1)
    timing.latency([model], seq_len=16, repeats=1, warmup=1)
    assert cuda_asked == [(runtime.CUDA, runtime.CPU)] * 2
    assert times.placement.provider == runtime.CPU and times.placement.nodes > 100  # the session that really ran
    timing.branch_times(model, seq_len=16, runs=1, options=runtime.Options(device="cpu"))
    assert cuda_asked[-1] == (runtime.CPU,)


def test_the_main_job_profiles_its_estimate_with_the_latencys_options(monkeypatch, fixture_path, tmp_path):
    from surgery.jobs import job

    seen = {}
    real = timing.branch_times
    monkeypatch.setattr(timing, "branch_times", lambda model, **kw: seen.setdefault("estimate", kw["options"]) and real(model, **kw))
    monkeypatch.setattr(timing, "latency", lambda models, **kw: seen.setdefault("latency", kw["options"]) and [_cuda_latency()] * 2)
    options = runtime.Options(device="cpu", threads=1)
    settings = job.JobSettings(DataSettings(seq_len=16), None, SelectionSettings(windows=2), eval_windows=1, latency=LatencySettings(repeats=1),
                               resources=Resources(options))
    outcome, _ = job.auto(fixture_path("llama"), tmp_path / "out", settings)
    assert seen == {"estimate": options, "latency": options}
    assert outcome.estimate_placement == "CPU"


GPU_IMAGE_LACKS = ("tokenizers", "transformers", "ray", "matplotlib")


def _smoke(script: str) -> subprocess.CompletedProcess:
    """benchmarks/SCRIPT --smoke as on the GPU machine's image, which has none of GPU_IMAGE_LACKS."""
    code = (
        f"import runpy, sys\nfor name in {GPU_IMAGE_LACKS!r}:\n    sys.modules[name] = None\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\nsys.argv = [{script!r}, '--smoke']\n"
        f"runpy.run_path({str(ROOT / 'benchmarks' / script)!r}, run_name='__main__')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)


def test_the_cuda_benchmark_smoke_run_needs_only_the_gpu_machines_packages_and_prints_each_graphs_placement():
    """Both block sets (the later half, all), five graphs each, as ORT runs them (every node placed on the smoke run's CPU)
    and on the fixed buffers of a CUDA graph's replay (which the CPU runs without a graph)."""
    done = _smoke("cuda.py")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "every node of every session on CPUExecutionProvider" in done.stdout
    header, _, *rows = [[c.strip() for c in line.split("|")[1:-1]] for line in done.stdout.splitlines() if line.startswith("|")]
    assert header[:5] == ["model", "graph", "runtime", "blocks", "placement"]
    graphs = ("original", "plain", "fused", "compensated", "fused compensated")
    assert [tuple(r[1:5]) for r in rows] == [
        (g, way, "-" if g == "original" else blocks, "CPU" if way == "ORT" else "CPU, fixed buffers")
        for blocks in ("1: 1", "2: 0-1") for way in ("ORT", "ORT + CUDA graphs") for g in graphs
    ]
    assert "float16" in rows[0][0] and all(cell.endswith(")") for r in rows for cell in r[5:])


def test_the_cuda_equality_check_smoke_run_scores_each_fixture_like_evaluate():
    """CPU against CPU: each fixture's row is surgery.measure.scoring's numbers for the fixture and its all-block plain parallel
    rewrite on 16 windows of 32 ids drawn by NumPy's generator seeded 0."""
    from surgery.jobs.job import parallel_form
    from surgery.model.blocks import find_blocks
    from surgery.text import data

    done = _smoke("cuda_equal.py")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r[0].strip(): r for r in (line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| tiny"))}
    assert sorted(rows) == ["tiny-gpt2", "tiny-llama"]
    for name, row in rows.items():
        model = graph.load(ROOT / "graphs" / name)
        vocab = runtime.vocab_size(runtime.session(model, runtime.Options(device="cpu")))
        ids = np.random.default_rng(0).integers(0, vocab, (16, 32), dtype=np.int64)
        windows = data.Windows(ids, np.zeros(16, np.int64), np.arange(16) * 32, "random ids")
        base, other = scoring.compare([model, parallel_form(model, range(len(find_blocks(model)))).model], windows)
        div = statistics.divergence(other)
        mine = {"loss": base.loss, "parallel loss": other.loss, "KL": div.kl, "top-1": div.top1}
        printed = [tuple(float(x) for x in cell.split("/")) for cell in row[1:5]]
        assert all(abs(a - mine[k]) < 1e-6 and a == b for (a, b), k in zip(printed, mine))
        assert 0 < mine["KL"] and 0 < mine["top-1"] < 1


def _kv_graph(dtype: ir.DataType, compute: str = "Cast") -> ir.Model:
    """input_ids and one past_key_values input of `dtype` [batch, 2, past, 4] -> logits [batch, seq, 3] float32: ones
    plus the past's sum, cast to float32 (compute Cast) or squared in `dtype` first (Mul)."""
    from onnx import TensorProto, helper

    past = "past_key_values.0.key"
    nodes = [] if compute == "Cast" else [helper.make_node("Mul", [past, past], ["squared"])]
    nodes += [
        helper.make_node("Cast", [past if compute == "Cast" else "squared"], ["as_float"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["as_float"], ["total"], keepdims=0),
        helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
        helper.make_node("Concat", ["ids_shape", "three"], ["logits_shape"], axis=0),
        helper.make_node("ConstantOfShape", ["logits_shape"], ["ones"], value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])),
        helper.make_node("Add", ["ones", "total"], ["logits"]),
    ]
    g = helper.make_graph(nodes, "kv", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
                                         helper.make_tensor_value_info(past, int(dtype), ["batch", 2, "past", 4])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", 3])],
                          [helper.make_tensor("three", TensorProto.INT64, [1], [3])])
    return ir.from_proto(helper.make_model(g, ir_version=9, opset_imports=[helper.make_opsetid("", 18)]))


@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16], ids=str)
def test_an_empty_kv_cache_is_fed_in_the_inputs_own_type(dtype):
    """The type comes from the input's tensor type: a bfloat16 cache (an OrtValue: numpy has no bfloat16 ORT reads)
    is not taken for float16 because its name contains it."""
    sess = runtime.session(_kv_graph(dtype), runtime.Options(device="cpu"))
    arg = sess.get_inputs()[1]
    assert runtime.element_type(arg) == dtype
    feed = runtime.feeds(sess, np.zeros((1, 5), np.int64))
    kv = feed["past_key_values.0.key"]
    if dtype == ir.DataType.BFLOAT16:
        assert isinstance(kv, runtime.ort.OrtValue) and kv.data_type() == "tensor(bfloat16)" and kv.shape() == [1, 2, 0, 4]
    else:
        assert kv.dtype == dtype.numpy() and kv.shape == (1, 2, 0, 4)
    np.testing.assert_array_equal(sess.run(["logits"], feed)[0], np.ones((1, 5, 3), np.float32))


def test_a_graph_computing_in_bfloat16_on_the_cpu_is_one_line():
    """ONNX Runtime's CPU provider has no bfloat16 Mul: the session is refused in one line that says where it runs."""
    from surgery.errors import SurgeryError

    with pytest.raises(SurgeryError) as error:
        runtime.session(_kv_graph(ir.DataType.BFLOAT16, compute="Mul"), runtime.Options(device="cpu"))
    message = str(error.value)
    assert "\n" not in message and message.startswith("ONNX Runtime's CPU provider cannot run this graph") and "--device cuda" in message


@pytest.fixture
def benchmarks_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


def test_the_torch_twin_of_each_block_form_computes_what_surgerys_graph_of_that_form_computes(benchmarks_path):
    """cuda_torch.py's forms, weights read from the synthetic graph, against ORT on the original and on surgery's plain
    and fused rewrites of the later block alone and of both: prefill logits and present, then one decode step."""
    import common
    import cuda_torch
    import torch

    from surgery.jobs.job import parallel_form

    shape = {**common.TINY, "dtype": "float32"}
    model = common.llama_shaped(**shape)
    gains = np.random.default_rng(2)
    for name, value in model.graph.initializers.items():  # gains other than ones, so a fold that mixes them up shows
        if name.startswith(("ln1.", "ln2.", "ln_f.")):
            value.const_value = ir.tensor(1 + 0.2 * gains.standard_normal(shape["d_model"]).astype(np.float32), name=name)
    twin = cuda_torch.Twin(model, shape, "cpu")
    ids = np.random.default_rng(1).integers(0, shape["vocab"], (2, 12))
    checked = 0
    for layers in ([1], [0, 1]):
        graphs = {"original": model, "plain": parallel_form(model, layers).model, "fused": parallel_form(model, layers, fused=True).model}
        for form, m in graphs.items():
            sess = runtime.session(m, runtime.Options(device="cpu"))
            prefill = sess.run(None, runtime.feeds(sess, ids[:, :11]))
            decode = sess.run(None, runtime.feeds(sess, ids[:, 11:], runtime.present_as_past(sess, prefill)))
            with torch.inference_mode():
                logits, present = twin.forward(torch.from_numpy(ids[:, :11]), None, form, layers)
                step, _ = twin.forward(torch.from_numpy(ids[:, 11:]), present, form, layers)
            np.testing.assert_allclose(logits.numpy(), prefill[0], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(present[1][0].numpy(), prefill[3], rtol=1e-4, atol=1e-6)  # present.1.key
            np.testing.assert_allclose(step.numpy(), decode[0], rtol=1e-4, atol=1e-5)
            checked += 1
    assert checked == 6 and [o.name for o in sess.get_outputs()][3] == "present.1.key"
    with torch.inference_mode():  # the forms differ where they should: the parallel block is another function
        plain, _ = twin.forward(torch.from_numpy(ids), None, "plain", [0, 1])
        original, _ = twin.forward(torch.from_numpy(ids), None, "original", [0, 1])
    assert (plain - original).abs().max() > 1e-3


def test_the_torch_benchmark_smoke_run_times_each_form_at_each_block_set():
    done = _smoke("cuda_torch.py")
    assert done.returncode == 0, done.stderr[-3000:]
    header, _, *rows = [[c.strip() for c in line.split("|")[1:-1]] for line in done.stdout.splitlines() if line.startswith("|")]
    assert header[:4] == ["model", "form", "torch", "blocks"] and len(header) == 4 + 2 * 3
    assert [tuple(r[1:4]) for r in rows] == [
        (f, "eager", "-" if f == "original" else blocks) for blocks in ("1: 1", "2: 0-1") for f in ("original", "plain", "fused")
    ]
    assert all(cell.endswith(")") for r in rows for cell in r[4:])


def test_the_ray_check_compares_every_number_of_the_report_but_the_seconds(benchmarks_path):
    import cuda_equal

    report = {"tool": {"version": 1}, "seconds": {"fit": 2.0}, "defect": {"c": [0.5, 0.25], "note": "x", "kept": True}, "mean": 3}
    assert cuda_equal.numbers(report) == {"/defect/c/0": 0.5, "/defect/c/1": 0.25, "/mean": 3.0}


@pytest.mark.slow
def test_the_whole_gpu_suite_runs_on_the_cpu_in_its_smoke_mode(tmp_path):
    """benchmarks/gpu.sh --smoke: the three steps, each a table in $OUT, the Ray actor's diagnose equal to this process's."""
    import os

    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--smoke"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stdout[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.{e}" for n in ("cuda", "cuda-torch", "cuda-equal") for e in ("md", "log"))
    for name, rows in (("cuda", 2 * 2 * 5), ("cuda-torch", 2 * 3)):  # block sets x ways x graphs; block sets x forms (eager)
        assert sum(line.startswith("| Llama-shaped") for line in (tmp_path / f"{name}.md").read_text().splitlines()) == rows
    equal = (tmp_path / "cuda-equal.md").read_text()
    (ray_row,) = [line.split("|")[1:-1] for line in equal.splitlines() if "Ray actor" in line]
    assert int(ray_row[1]) > 100 and float(ray_row[2]) <= 1e-4 and "\nequal:" in equal
