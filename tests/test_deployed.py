"""Graphs as people deploy them: the ONNX Runtime GenAI builder's (fp32, int4) and the ORT transformers
optimizer's, built inside the test from tiny random HF models, read and rewritten like our own exports."""

import collections
import dataclasses
import json

import numpy as np
import onnx_ir as ir
import pytest
from typer.testing import CliRunner

from surgery.analysis import probe as probe_graph
from surgery.analysis.fit_graph import fit_graph, kinds, switched
from surgery.cli import app
from surgery.compensation.fitting import FitSettings
from surgery.diagnostics import DiagnoseSettings
from surgery.engine import runtime
from surgery.errors import SurgeryError
from surgery.files import canonical, graph, metadata, ops
from surgery.measure.timing import LatencySettings
from surgery.model import nodes
from surgery.model.blocks import find_blocks
from surgery.model.embedding import embedding_table
from surgery.passes import MODES, Fix, ablate, compensate, fold, fuse, parallelize, projection
from surgery.text.data import DataSettings
from tests.helpers import FAMILIES, FLOAT32, Tol, assert_found_tensors_equal_hooked, assert_logits_equal
from tests.helpers import logits as ids_logits

IDS = np.random.default_rng(2).integers(0, 512, size=(2, 9))
# Every graph equals its HF model to float error. int4: the builder's MatMulNBits quantize activations to int8 on
# CPU (accuracy_level 4), 7e-3 away from the HF model with the dequantized weights on logits of magnitude 0.6,
# farther than an edit such as mlp tangential moves them; its graphs are compared on copies computing in fp32
# (`exact`), where they equal that HF model to float error.
TOL = FLOAT32.atol  # 1e-4, FLOAT32's rtol and atol
VARIANTS = {
    "genai-fp32": ("llama", "genai", "fp32"),
    "genai-int4": ("llama-tied", "genai", "int4"),  # tied embeddings: the table is GatherBlockQuantized of lm_head's weights
    "ortopt-llama": ("llama", "ortopt", 2),  # SkipSimplifiedLayerNormalization, QuickGelu
    "ortopt-llama-rotary": ("llama", "ortopt", 0),  # ... and RotaryEmbedding
    "ortopt-gpt2": ("gpt2", "ortopt", 2),  # SkipLayerNormalization with the mlp bias folded in, FastGelu
}
BUILDS = {**VARIANTS, "genai-fp16": ("llama", "genai", "fp16"), "genai-int4-qwen2": ("qwen2", "genai", "int4"),
          "genai-int4-llama": ("llama", "genai", "int4")}  # builds some tests use beside the compared variants
pytestmark = pytest.mark.xdist_group("deployed")


class Builds:
    """Tiny random HF models (seed 5) and what optimum (conftest's tiny_export), the GenAI builder and the ORT
    optimizer make of them, each made once."""

    def __init__(self, root, tiny_export):
        self.root, self.tiny_export, self._made = root, tiny_export, {}

    def _once(self, key, make):
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def hf(self, family):
        pytest.importorskip("torch")
        tied = {"tie_word_embeddings": True} if family.endswith("-tied") else {}
        return self.tiny_export.hf(family.removesuffix("-tied"), seed=5, **tied)

    def optimum(self, family):
        pytest.importorskip("torch")
        return self.tiny_export(family, seed=5).onnx

    def variant(self, name):
        from graphs.deployed import genai_build, ort_optimize

        family, tool, option = BUILDS[name]
        if tool == "genai":
            pytest.importorskip("onnxruntime_genai")  # only the tests on GenAI builder graphs need it
            return self._once(name, lambda: genai_build(self.hf(family), self.root / name, option))
        return self._once(name, lambda: ort_optimize(self.optimum(family), self.root / name, level=option))


class Deployed:
    """A deployed graph and its HF model (int4: with the dequantized weights)."""

    def __init__(self, name, builds):
        family, _, option = VARIANTS[name]
        self.folder = builds.variant(name)  # skips the test without torch or, for the GenAI builder's, onnxruntime_genai
        from transformers import AutoModelForCausalLM

        from tests.reference import with_genai_int4_weights

        self.onnx = graph.load(self.folder)
        self.torch = AutoModelForCausalLM.from_pretrained(builds.hf(family), attn_implementation="eager").eval()
        self.int4 = option == "int4"
        if self.int4:
            with_genai_int4_weights(self.torch, self.onnx)


def exact(model: ir.Model) -> ir.Model:
    """`model`, or where it has MatMulNBits a copy whose MatMulNBits compute with fp32 activations (accuracy_level 0
    instead of the builder's 4 on CPU, int8 activations): what a graph is compared with its HF model on."""
    if not any(n.op_type == "MatMulNBits" for n in model.graph):
        return model
    model = model.clone()  # weights shared, not copied
    for node in model.graph:
        if node.op_type == "MatMulNBits":
            node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", 0)
    return model


@pytest.fixture(scope="module")
def builds(tmp_path_factory, tiny_export):
    return Builds(tmp_path_factory.mktemp("deployed"), tiny_export)


@pytest.fixture(scope="module", params=list(VARIANTS))
def deployed(request, builds):
    return Deployed(request.param, builds)


def logits(model, ids=IDS, extra=None) -> np.ndarray:
    return ids_logits(model, ids, extra)


def contrib_ops(path) -> collections.Counter:
    model = ir.load(graph.resolve(path))
    return collections.Counter(n.op_type for n in model.graph if n.domain == ops.MS)


def test_found_tensors_equal_the_hooked_hf_model(deployed):
    from surgery.model.facts import describe

    facts = describe(deployed.folder)
    assert (facts.n_layers, facts.d_model, facts.vocab) == (3, deployed.torch.config.hidden_size, 512)
    blocks = find_blocks(deployed.onnx)
    assert [b.form for b in blocks] == ["sequential"] * 3
    assert all(b.mlp_kind == ("plain" if deployed.torch.config.model_type == "gpt2" else "gated") for b in blocks)
    got, names = assert_found_tensors_equal_hooked(deployed.onnx, deployed.torch, IDS, tensor_tol=Tol(TOL, TOL, of_scale=True), prepare=exact)
    if deployed.int4:  # and, to float error, the unrewritten int4 graph's own values, where it exposes them
        raw = ir.load(graph.resolve(deployed.folder))
        canonical.state_kv_sizes(raw, deployed.folder)
        present = {v.name for n in raw.graph for v in n.outputs}
        exposed = [v for _, _, v in names if v in present]
        assert len(exposed) == len(names) - 1  # the last block's resid_post is a sum the final norm keeps to itself
        own = runtime.session(exact(probe_graph.tap(raw, exposed)))
        values = dict(zip([o.name for o in own.get_outputs()], own.run(None, runtime.feeds(own, IDS))))
        for name in exposed:
            np.testing.assert_allclose(got[name], values[name], rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("layers", [{1}, {0, 1, 2}], ids=str)
def test_parallelize_matches_the_hooked_hf_model(deployed, layers):
    from tests.reference import edited_logits

    result = parallelize(deployed.onnx, layers)
    expected = edited_logits(deployed.torch, IDS, parallel=layers)
    assert_logits_equal(exact(result.model), expected, IDS)
    assert [b.is_parallel for b in find_blocks(result.model)] == [layer in layers for layer in range(3)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("branch", ["mlp", "attn"])
def test_ablate_matches_the_hooked_hf_model(deployed, branch, mode):
    from tests.reference import edited_logits

    scale = 0.5 if mode == "scale" else None
    result = ablate(deployed.onnx, branch, mode, {0, 1, 2}, scale)
    expected = edited_logits(deployed.torch, IDS, branch_edits=[(branch, mode, {0, 1, 2}, scale)])
    assert_logits_equal(exact(result.model), expected, IDS)


@pytest.mark.parametrize("deployed", ["genai-int4"], indirect=True)
def test_int4_comparisons_tell_an_edit_from_none(deployed):
    """On the fp32-activation copy the unedited int4 graph is float error away from its HF model and far from the
    HF model with mlp tangential, so a rewrite that did nothing fails the comparisons above; the builder's own
    int8 activations are farther from the HF model than the tolerance, which is why those compare on the copy."""
    from tests.reference import edited_logits

    exact_logits, expected = logits(exact(deployed.onnx)), edited_logits(deployed.torch, IDS)
    tangential = edited_logits(deployed.torch, IDS, branch_edits=[("mlp", "tangential", {0, 1, 2}, None)])
    assert np.abs(exact_logits - expected).max() < TOL
    assert np.abs(exact_logits - tangential).max() > 30 * TOL
    assert np.abs(logits(deployed.onnx) - expected).max() > 10 * TOL


def test_written_rewrites_keep_the_input_s_fused_ops(deployed, tmp_path):
    """Saved, a rewrite holds the same fused ops as its input (a parallel block's two norms stay two
    Skip norms) and nothing of the split form; loaded again it is the same rewrite."""
    model = parallelize(deployed.onnx, {1}).model
    model = ablate(model, "mlp", "tangential", {0, 1, 2}).model
    out = graph.write(model, tmp_path / "out", deployed.folder)
    assert contrib_ops(out) == contrib_ops(deployed.folder)
    written = ir.load(out)
    assert not any(metadata.UNFUSED in n.metadata_props for n in written.graph)
    again = graph.load(out.parent)
    assert [b.form for b in find_blocks(again)] == ["sequential", "parallel", "sequential"]
    assert_logits_equal(again, logits(model), IDS, Tol(1e-5, 1e-5))
    names = {p.name for p in deployed.folder.iterdir()} - {p.name for p in graph.external_data_files(deployed.onnx)}
    assert names <= {p.name for p in out.parent.iterdir()}  # genai_config.json, tokenizer files, ...


def test_fuse_and_compensate_match_the_hooked_hf_model(deployed):
    from tests.reference import edited_logits

    if deployed.int4:
        pytest.skip("MatMulNBits weights: folding refuses (next test)")
    d = deployed.torch.config.hidden_size
    rng = np.random.default_rng(3)
    fix = (0.05 * rng.standard_normal((d, d)), 0.05 * rng.standard_normal((d, d)), 0.05 * rng.standard_normal(d))
    expected = edited_logits(deployed.torch, IDS, parallel={1}, fixes={1: fix})
    assert_logits_equal(compensate(deployed.onnx, {1: Fix(*fix)}).model, expected, IDS)
    sides = (0.05 * rng.standard_normal((d, d)), 0.05 * rng.standard_normal(d))  # and an mlp input side, into W_gate / W_up
    expected = edited_logits(deployed.torch, IDS, parallel={1}, fixes={1: fix + sides})
    assert_logits_equal(compensate(deployed.onnx, {1: Fix(*fix, w_in=sides[0], b_in=sides[1])}).model, expected, IDS)
    assert np.abs(logits(compensate(deployed.onnx, {1: Fix(*fix)}).model) - expected).max() > 10 * TOL
    fused = fuse(deployed.onnx, {0, 1, 2}).model
    assert_logits_equal(fused, edited_logits(deployed.torch, IDS, parallel={0, 1, 2}), IDS)


@pytest.mark.parametrize("name", ["genai-int4", "genai-int4-llama", "genai-int4-qwen2"])
def test_fused_int4_blocks_equal_the_unfused_int4_rewrite(builds, name):
    """llama tied and untied, qwen2 (qkv biases): fused MatMulNBits blocks, plain and compensated, equal the unfused
    int4 rewrite to 1e-5 relative on logits (fp32 activations: op for op the same arithmetic); the fused form has
    one normalisation and one [o ; down] MatMulNBits per block, and keeps every block's codes unless a fix is folded."""
    model = graph.load(builds.variant(name))
    layers = {0, 2}
    fused = fuse(model, layers).model
    assert [b.form for b in find_blocks(fused)] == ["fused", "sequential", "fused"]
    count = lambda m, op: sum(n.op_type == op for n in m.graph)  # noqa: E731
    assert count(fused, "MatMulNBits") == count(model, "MatMulNBits") - 2 * len(layers)  # [gate|up], [o ; down]
    reference = logits(exact(parallelize(model, layers).model))
    assert_logits_equal(exact(fused), reference, IDS, Tol(1e-5, 1e-5, of_scale=True))
    rng = np.random.default_rng(4)
    d = embedding_table(model)[1]
    fixes = {l: Fix(0.05 * rng.standard_normal((d, d)), 0.05 * rng.standard_normal((d, d)), 0.05 * rng.standard_normal(d)) for l in layers}
    compensated = logits(exact(compensate(model, fixes).model))
    assert_logits_equal(exact(fuse(model, layers, fixes).model), compensated, IDS, Tol(1e-5, 1e-5, of_scale=True))
    assert np.abs(compensated - reference).max() > 100 * 1e-5 * np.abs(reference).max()


@pytest.mark.parametrize("deployed", ["genai-int4"], indirect=True)
def test_int4_blocks_that_cannot_be_folded_into_say_why_in_one_line(deployed):
    model = deployed.onnx.clone()
    o_proj = next(n for n in model.graph if n.op_type == "MatMulNBits" and "layers.0/attn/o_proj" in n.name)
    down = next(n for n in model.graph if n.op_type == "MatMulNBits" and "layers.0/mlp/down_proj" in n.name)
    for node in (o_proj, down):  # read from the attributes alone: the codes are not looked at
        node.attributes["block_size"] = ir.AttrInt64("block_size", 4 * o_proj.attributes["K"].value)
    with pytest.raises(SurgeryError, match=r"^cannot fuse block 0: .*K \(\d+\) is not a multiple of its block size"):
        fuse(model, {0})
    o_proj.attributes["bits"] = ir.AttrInt64("bits", 3)
    for verb, run in (("fuse", lambda: fuse(model, {0})), ("compensate", lambda: compensate(model, {0: Fix.gate(0.9)}))):
        with pytest.raises(SurgeryError, match=rf"^cannot {verb} block 0: .*MatMulNBits, and its weights are 3-bit"):
            run()


@pytest.mark.parametrize("deployed", ["genai-int4"], indirect=True)
def test_compensated_int4_fold_is_the_numpy_dequantize_fold_requantize(deployed):
    """W_o (I + w_a) and W_down (I + w_p) from the dequantized weights, rounded again on the node's own scales in
    NumPy (tests.reference's dequantization, round half up), put into the HF model: the compensated int4 graph
    equals it (fp32 activations), written and switched on in a switchboard (at the builder's accuracy_level too)."""
    from surgery.analysis import switchboard as board_graph
    from tests.reference import edited_logits

    torch = pytest.importorskip("torch")
    hf = deployed.torch
    d = hf.config.hidden_size
    rng = np.random.default_rng(3)
    fix = (0.05 * rng.standard_normal((d, d)), 0.05 * rng.standard_normal((d, d)), 0.05 * rng.standard_normal(d))
    initializers = deployed.onnx.graph.initializers
    before = {name: module.weight.detach().clone() for name, module in (("o", hf.model.layers[1].self_attn.o_proj), ("down", hf.model.layers[1].mlp.down_proj))}
    try:
        for (name, module), w in zip((("o", hf.model.layers[1].self_attn.o_proj), ("down", hf.model.layers[1].mlp.down_proj)), fix[:2]):
            scales = initializers[f"model.layers.1.{'attn.o_proj' if name == 'o' else 'mlp.down_proj'}.MatMul.weight_scales"].const_value.numpy()
            k = module.weight.shape[1]
            step = np.repeat(scales.astype(np.float64).reshape(d, -1), 32, axis=1)[:, :k].T  # [K, N]
            folded = module.weight.detach().double().numpy().T @ (np.eye(d) + w)
            requantized = (np.clip(np.floor(folded / step + 0.5) + 8, 0, 15) - 8) * step
            with torch.no_grad():
                module.weight.copy_(torch.from_numpy(requantized.T))
        expected = edited_logits(hf, IDS, parallel={1}, fixes={1: (np.zeros((d, d)), np.zeros((d, d)), fix[2])})
    finally:
        with torch.no_grad():
            hf.model.layers[1].self_attn.o_proj.weight.copy_(before["o"])
            hf.model.layers[1].mlp.down_proj.weight.copy_(before["down"])
    result = compensate(deployed.onnx, {1: Fix(*fix)})
    assert_logits_equal(exact(result.model), expected, IDS)
    assert np.abs(logits(exact(parallelize(deployed.onnx, {1}).model)) - expected).max() > 30 * TOL  # the fold matters
    assert [n.op_type for n in result.model.graph].count("MatMulNBits") == [n.op_type for n in deployed.onnx.graph].count("MatMulNBits")
    on = switched(3, {1: "compensated"})
    for model in (exact(deployed.onnx), deployed.onnx):  # the switch's MatMulNBits computes as the written one
        board = board_graph.switchboard(model, kinds({1: Fix(*fix)}))
        written = compensate(model, {1: Fix(*fix)}).model
        assert_logits_equal(board, logits(written), IDS, Tol(1e-6, 1e-6), extra={board_graph.SWITCHES: on})


def test_ort_optimizer_fuses_every_norm_of_a_parallel_rewrite(tmp_path):
    """The optimizer fuses an Add into the one norm after it only: a parallel block's ln2 reads its own copy
    of resid_pre, so both of its norms still fuse."""
    pytest.importorskip("torch")  # optimize_model imports it
    from graphs.deployed import ort_optimize
    llama = FAMILIES["llama"].folder
    rewritten = graph.write(parallelize(graph.load(llama), {1, 2}).model, tmp_path / "par", llama)
    original = ort_optimize(llama, tmp_path / "opt", level=1)
    optimized = ort_optimize(rewritten.parent, tmp_path / "par-opt", level=1)
    assert contrib_ops(optimized)["SkipSimplifiedLayerNormalization"] == contrib_ops(original)["SkipSimplifiedLayerNormalization"] == 6
    assert [b.form for b in find_blocks(graph.load(optimized))] == ["sequential", "parallel", "parallel"]


def test_rewritten_genai_folder_generates_in_onnxruntime_genai(builds, tmp_path):
    """parallelize on a GenAI builder folder -> a folder og.Model loads; greedy tokens equal the HF model's
    with the same blocks made parallel by hooks (fed token ids)."""
    built = builds.variant("genai-fp32")
    from transformers import AutoModelForCausalLM

    from graphs.deployed import genai_greedy
    from tests.reference import greedy

    result = CliRunner().invoke(app, ["parallelize", str(built), "--layers", "0,2", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "genai_config.json").read_text()) == json.loads((built / "genai_config.json").read_text())

    prompt, steps = [0, 17, 99, 5, 300], 12
    reference = AutoModelForCausalLM.from_pretrained(builds.hf("llama"), attn_implementation="eager").eval()
    tokens = genai_greedy(tmp_path / "out", prompt, steps)
    assert tokens == greedy(reference, prompt, steps, parallel={0, 2})
    assert tokens != greedy(reference, prompt, steps)  # the parallel blocks changed what it says


@pytest.mark.parametrize("name", ["genai-int4", "genai-fp16"])
def test_default_main_job_on_a_genai_folder_generates_in_onnxruntime_genai(builds, tmp_path, name):
    """`surgery parallelize` with its defaults (auto, compensation asked for) on a GenAI int4 or fp16 folder: the
    output keeps genai_config.json and the tokenizer files, og.Model loads it, and its greedy tokens equal greedy
    decoding of the same graph by ONNX Runtime (the whole sequence each step, no cache: the same kernels; int4 at
    the builder's accuracy_level 4)."""
    from graphs.deployed import genai_greedy
    from surgery.engine import runtime

    built = builds.variant(name)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["parallelize", str(built), "-o", str(out), "--seq-len", "64", "--fit-windows", "4",
                                      "--windows", "4", "--eval-windows", "2", "--no-latency", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["selection"]["layers"]  # something was rewritten
    beside = lambda folder: {p.name for p in folder.iterdir() if not p.name.startswith("model.onnx")} - {"selection.json", "selection.png"}  # noqa: E731
    assert "genai_config.json" in beside(built) and "tokenizer.json" in beside(built) and beside(out) == beside(built)
    for name in beside(built):
        assert (out / name).read_bytes() == (built / name).read_bytes(), name

    prompt, steps = [0, 17, 99, 5, 300], 20
    tokens = genai_greedy(out, prompt, steps)  # og stops early at the end-of-text token (0)
    session, ids = runtime.session(out), list(prompt)
    for _ in tokens:
        ids.append(int(session.run(["logits"], runtime.feeds(session, np.array([ids])))[0][0, -1].argmax()))
    assert len(tokens) >= 5 and tokens == ids[len(prompt):] and (len(tokens) == steps or tokens[-1] == 0)


def test_an_op_the_table_does_not_know_is_one_line(tmp_path):
    """A block holding an op outside the standard domain that surgery's op table does not describe."""
    model = ir.load(FAMILIES["llama"].folder / "model.onnx")
    block = find_blocks(graph.load(FAMILIES["llama"].folder))[1]
    values = nodes.values_by_name(model)
    down = values[block.mlp_out].producer()  # the down projection; its input is act(gate) * up
    gated = down.inputs[0].producer()
    gated.domain, gated.op_type = "example.custom", "GatedMul"
    model.opset_imports["example.custom"] = 1
    ir.save(model, tmp_path / "custom.onnx")
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "custom.onnx")])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: block 1 of ") and "GatedMul (example.custom)" in lines[0], result.output


def test_diagnose_and_auto_read_a_genai_graph_like_the_optimum_export(builds, tmp_path):
    """The same weights built by the GenAI builder and by optimum: the one-pass scores and the single-layer
    dNLLs agree; auto on the int4 build ranks by C_l^comp and writes compensated MatMulNBits blocks, their codes
    chosen error-aware, with as many MatMulNBits as the input."""
    from surgery.diagnostics import diagnose
    from surgery.jobs import job, select

    reports = [
        diagnose(path, DiagnoseSettings(DataSettings(seq_len=64), windows=2, eval_windows=2, only=("deficit", "defect", "gate"))).to_json()
        for path in (builds.optimum("llama"), builds.variant("genai-fp32"))
    ]
    for section, key in (("deficit", "deficit"), ("defect", "c"), ("defect", "c_stream"), ("gate", "alpha"), ("defect", "dnll_parallel")):
        np.testing.assert_allclose(reports[1][section][key], reports[0][section][key], rtol=1e-3, atol=1e-5, err_msg=key)

    settings = job.JobSettings(DataSettings(seq_len=64), FitSettings(windows=4), select.SelectionSettings(select.Budget(None, None), windows=2),
                               eval_windows=2, latency=LatencySettings(measure=False))
    outcome, written = job.auto(builds.variant("genai-int4"), tmp_path / "auto", settings)
    chosen = outcome.selection
    assert chosen.score == "c_comp" and chosen.layers == (0, 1, 2) and set(chosen.forms.values()) == {"compensated"}
    assert chosen.requantize == "gptq" and all(chosen.fits[layer].fix.packed[0] is not None for layer in range(3))
    count = lambda path: sum(n.op_type == "MatMulNBits" for n in ir.load(path).graph)  # noqa: E731
    assert count(written) == count(graph.resolve(builds.variant("genai-int4")))
    assert [b.fix for b in find_blocks(graph.load(written))] == ["compensated"] * 3


@pytest.mark.parametrize("name", ["genai-fp32", "genai-int4"])
def test_kl_and_top1_agreement_equal_numpy_on_genai_graphs(builds, name, tmp_path, numpy_divergence):
    """evaluate's KL, p99 KL and top-1 agreement on GenAI builder graphs (GroupQueryAttention, MatMulNBits)
    equal float64 NumPy on the raw logits of the original and a parallelized copy."""
    from surgery.measure import scoring, statistics
    from surgery.text import data

    folder = builds.variant(name)
    rewritten = graph.write(parallelize(graph.load(folder), [0, 1]).model, tmp_path / "parallel", like=folder)
    w = data.windows(folder, seq_len=32, max_windows=4)
    _, other = scoring.compare([folder, rewritten], w)
    got, expected = statistics.divergence(other), numpy_divergence(folder, rewritten, w)
    assert got.kl > 1e-5
    assert got.kl == pytest.approx(expected["kl"], rel=1e-5, abs=1e-7)
    assert got.p99 == pytest.approx(expected["p99"], rel=1e-5, abs=1e-6)
    assert got.top1 == pytest.approx(expected["top1"])


@pytest.mark.parametrize("deployed", ["genai-int4"], indirect=True)
def test_the_int4_fit_gathers_the_output_projections_input_moments_and_folds_error_aware(deployed):
    """The fit pass on an int4 graph sums x x' of W_o's input and of the parallel block's W_down input (the HF model
    with the dequantized weights, block 1 parallel, hooks on o_proj and down_proj; token 0 left out), and each fix
    carries the GPTQ codes of W_o (I + w_a) and W_down (I + w_p) on those moments; `nearest` leaves them to the fold."""
    from surgery import compensation
    from surgery.text import data
    from tests.reference import Edits

    torch = pytest.importorskip("torch")
    model, hf = exact(deployed.onnx), deployed.torch
    windows = data.Windows(IDS, np.zeros(len(IDS), np.int64), np.zeros(len(IDS), np.int64), "ids")
    seen = {"o_in": [], "down_in": []}
    layer = hf.model.layers[1]
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen["o_in"].append(a[0][:, 1:].double().numpy())),
             layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: seen["down_in"].append(a[0][:, 1:].double().numpy()))]
    try:
        with Edits(hf, parallel={1}), torch.no_grad():
            hf(input_ids=torch.from_numpy(IDS), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    graph_ = fit_graph(model, layers=[1])
    sums, *_ = compensation.Accumulator(graph_).run([1], IDS, 0, switched(3))
    for name, xs in seen.items():
        x = np.concatenate(xs, axis=0).reshape(-1, xs[0].shape[-1])
        expected = x.T @ x
        np.testing.assert_allclose(sums[1].grams[name], expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    fit = compensation.fit(model, windows, [1])[1]
    values = nodes.values_by_name(model)
    block = find_blocks(model)[1]
    attn, mlp = (projection.producing(values[v], 1, v) for v in (block.attn_out, block.mlp_out))
    side = Fix(w_in=fit.fix.w_in, b_in=fit.fix.b_in, packed_in=fit.fix.packed_in)  # the fit's input side, which W_down's input has passed
    sided = compensation.Accumulator(fit_graph(model, layers=[1], input_sides={1: side})).run([1], IDS, 0, switched(3))[0][1]
    for p, (w, _), packed, name in zip((attn, mlp), fold.output_weights(fit.fix, attn, mlp), fit.fix.packed, ("o_in", "down_in")):
        np.testing.assert_array_equal(packed, p.quant.packed(p.quant.gptq(w, sided.grams[name])))
        assert not np.array_equal(packed, p.quant.packed(p.quant.round(w)))  # error-aware is not rounding to nearest
    nearest = compensation.fit(model, windows, [1], settings=FitSettings(requantize="nearest"))[1].fix
    assert nearest.packed == (None, None) and nearest.packed_in == () and nearest.w_in is not None
    # the input side, folded into W_gate / W_up: its codes error-aware on sum u u', u what they read in the parallel block
    seen_u = []
    hook = (layer.mlp.gate_proj if hasattr(layer.mlp, "gate_proj") else layer.mlp.up_proj).register_forward_pre_hook(
        lambda m, a: seen_u.append(a[0][:, 1:].double().numpy()))
    try:
        with Edits(hf, parallel={1}), torch.no_grad():
            hf(input_ids=torch.from_numpy(IDS), use_cache=False)
    finally:
        hook.remove()
    inputs = compensation.Accumulator(fit_graph(model, layers=[1], stage="inputs")).run([1], IDS, 0, switched(3), stage="inputs")[0][1]
    u = np.concatenate(seen_u, axis=0).reshape(-1, seen_u[0].shape[-1])
    d = u.shape[1]
    gram = inputs.zz[:, :d, :d].sum(0)
    np.testing.assert_allclose(gram, u.T @ u, rtol=1e-4, atol=1e-4 * np.abs(u.T @ u).max())
    readers = fold.input_projections(model, values, block)[1]
    assert fit.fix.w_in is not None and len(fit.fix.packed_in) == len(readers)
    for p, codes in zip(readers, fit.fix.packed_in):
        np.testing.assert_array_equal(codes, p.quant.packed(p.quant.gptq(fold.input_weights(fit.fix, p)[0], gram)))


@pytest.mark.parametrize("name", ["genai-int4", "genai-int4-llama", "genai-int4-qwen2"])
def test_compensated_int4_codes_are_numpy_s_rounding_of_the_folded_weight(builds, name):
    """llama tied and untied, qwen2: the codes compensate writes for W_o and W_down are, byte for byte, NumPy's
    dequantize (tests.reference) -> W (I + w) in float64 -> round half up on the node's scales -> pack, low nibble
    first; the scales are the node's own, and every other MatMulNBits keeps its codes."""
    from tests.reference import dequantize_matmul_nbits

    model = graph.load(builds.variant(name))
    d = embedding_table(model)[1]
    rng = np.random.default_rng(6)
    fix = Fix(0.05 * rng.standard_normal((d, d)), 0.05 * rng.standard_normal((d, d)), 0.05 * rng.standard_normal(d))
    written = compensate(model, {1: fix}).model
    before = {n.name: n for n in model.graph if n.op_type == "MatMulNBits"}
    changed = 0
    for node in (n for n in written.graph if n.op_type == "MatMulNBits"):
        a = {k: v.value for k, v in node.attributes.items()}
        codes, scales = (node.inputs[i].const_value.numpy() for i in (1, 2))
        old = before[node.name]
        np.testing.assert_array_equal(scales, old.inputs[2].const_value.numpy())
        w = {"o_proj": fix.w_a, "down_proj": fix.w_p}.get(node.name.split("/")[-2]) if "layers.1/" in node.name else None
        if w is None:
            np.testing.assert_array_equal(codes, old.inputs[1].const_value.numpy())
            continue
        folded = dequantize_matmul_nbits(old.inputs[1].const_value.numpy(), scales, a["K"], a["N"], 4, a["block_size"]) @ (np.eye(d) + w)
        step = np.repeat(scales.astype(np.float64).reshape(a["N"], -1), a["block_size"], axis=1)[:, : a["K"]]  # [N, K]
        q = np.full((a["N"], codes.shape[1] * a["block_size"]), 8.0)
        q[:, : a["K"]] = np.clip(np.floor(folded.T / step + 0.5) + 8, 0, 15)
        q = q.astype(np.uint8).reshape(a["N"], -1, 2)
        np.testing.assert_array_equal(codes, (q[..., 0] | (q[..., 1] << 4)).reshape(codes.shape))
        changed += 1
    assert changed == 2


@pytest.mark.parametrize("name", ["genai-int4", "genai-int4-qwen2"])
def test_an_int4_fix_s_input_side_is_numpy_s_rounding_of_the_folded_gate_and_up(builds, name):
    """The input side folded into MatMulNBits W_gate / W_up: their codes are NumPy's round half up of (I + w_in) W on the
    node's own scales, b_in W is one bias Add; written, switched on in a switchboard and fused, the three compute the
    same logits (fp32 activations), and codes chosen by the fit (Fix.packed_in) are written as they are."""
    from surgery.analysis import switchboard as board_graph
    from tests.reference import dequantize_matmul_nbits

    model = graph.load(builds.variant(name))
    d = embedding_table(model)[1]
    rng = np.random.default_rng(7)
    fix = Fix(0.05 * rng.standard_normal((d, d)), 0.05 * rng.standard_normal((d, d)), 0.05 * rng.standard_normal(d),
              w_in=0.05 * rng.standard_normal((d, d)), b_in=0.05 * rng.standard_normal(d))
    written = compensate(model, {1: fix}).model
    before = {n.name: n for n in model.graph if n.op_type == "MatMulNBits"}
    block = find_blocks(model)[1]
    u, readers = fold.input_projections(model, nodes.values_by_name(model), block)
    assert readers and all(p.quant is not None for p in readers)
    shifts = []
    for p in readers:
        node = next(n for n in written.graph if n.name == p.node.name)
        a = {k: v.value for k, v in node.attributes.items()}
        old, codes = before[p.node.name], node.inputs[1].const_value.numpy()
        scales = old.inputs[2].const_value.numpy()
        w = dequantize_matmul_nbits(old.inputs[1].const_value.numpy(), scales, a["K"], a["N"], 4, a["block_size"])
        folded = (np.eye(d) + fix.w_in) @ w
        step = np.repeat(scales.astype(np.float64).reshape(a["N"], -1), a["block_size"], axis=1)[:, : a["K"]]
        q = np.full((a["N"], codes.shape[1] * a["block_size"]), 8.0)
        q[:, : a["K"]] = np.clip(np.floor(folded.T / step + 0.5) + 8, 0, 15)
        q = q.astype(np.uint8).reshape(a["N"], -1, 2)
        np.testing.assert_array_equal(codes, (q[..., 0] | (q[..., 1] << 4)).reshape(codes.shape))
        [(add, _)] = node.outputs[0].uses()
        assert add.op_type == "Add"
        np.testing.assert_allclose(add.inputs[1].const_value.numpy(), fix.b_in @ w, rtol=1e-6, atol=1e-6)
        shifts.append(p)
    reference = logits(exact(written))
    assert np.abs(reference - logits(exact(compensate(model, {1: dataclasses.replace(fix, w_in=None, b_in=None)}).model))).max() > 1e-3
    board = board_graph.switchboard(exact(model), kinds({1: fix}))
    assert_logits_equal(board, reference, IDS, Tol(1e-6, 1e-6), extra={board_graph.SWITCHES: switched(3, {1: "compensated"})})
    assert_logits_equal(exact(fuse(model, {1}, {1: fix}).model), reference, IDS, Tol(1e-5, 1e-5, of_scale=True))
    chosen = tuple(p.quant.packed(p.quant.round(np.zeros_like(p.weight))) for p in readers)  # any codes: they are written as given
    again = compensate(model, {1: dataclasses.replace(fix, packed_in=chosen)}).model
    for p, codes in zip(readers, chosen):
        np.testing.assert_array_equal(next(n for n in again.graph if n.name == p.node.name).inputs[1].const_value.numpy(), codes)


@pytest.mark.parametrize("deployed", ["genai-int4"], indirect=True)
def test_the_int4_fit_graph_s_parallel_mlp_reads_its_input_side_as_compensate_writes_it(deployed):
    """With an input side on MatMulNBits W_gate / W_up, the fit graph's parallel mlp output (mlp_x, block 1 switched
    sequential) is the written compensated block's mlp_out: the requantized codes compensate writes, not the side as
    float ops before the original codes; the output side is then fitted to what will run."""
    from surgery.analysis import switchboard as board_graph
    from surgery.analysis.fit_graph import fit_tap

    model = exact(deployed.onnx)
    d = embedding_table(model)[1]
    rng = np.random.default_rng(8)
    side = Fix(w_in=0.05 * rng.standard_normal((d, d)), b_in=0.05 * rng.standard_normal(d))
    taps = runtime.session(fit_graph(model, layers=[1], input_sides={1: side}))
    got = taps.run([fit_tap(1, "mlp_x")], runtime.feeds(taps, IDS[:1], extra={board_graph.SWITCHES: switched(3)}))[0]
    written = compensate(model, {1: side}).model
    mlp_out = find_blocks(written)[1].mlp_out
    written.graph.outputs.append(nodes.values_by_name(written)[mlp_out])
    session = runtime.session(written)
    expected = session.run([mlp_out], runtime.feeds(session, IDS[:1]))[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
