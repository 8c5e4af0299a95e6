"""Plain helpers several test modules share: the tiny families, token ids, logits, the parity comparisons, a graph
with no blocks.

Tests import these from here, never from one another (conftest's `tiny_export` caches what `save_tiny` builds)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import onnx_ir as ir

from graphs.make_fixtures import COMMITTED, FAMILIES, Family, save_tiny  # noqa: F401  the one table of tiny families, their builder
from surgery.engine import runtime
from surgery.files import graph

IDS = np.random.default_rng(1).integers(0, 512, size=(2, 9))


PROGRESS = re.compile(r"^(.+: (started \(\d+ steps\)|done in .+|\d+/\d+ \(\d+ %\) after .+)|still working after .+)$")


def said(stderr: str) -> list[str]:
    """The lines of a command's stderr other than its progress lines (surgery.report.log writes those when stderr is
    not a terminal): errors, warnings, anything else."""
    return [line for line in stderr.strip().splitlines() if not PROGRESS.match(line)]


def logits(model: ir.Model, ids: np.ndarray = IDS, extra: dict | None = None) -> np.ndarray:
    """The graph's logits on `ids`: [batch, pos, vocab] (extra: inputs surgery added, such as a switchboard's)."""
    session = runtime.session(model)
    return session.run(["logits"], runtime.feeds(session, ids, extra=extra))[0]


@dataclasses.dataclass(frozen=True)
class Tol:
    """|got - expected| <= atol + rtol |expected| elementwise; of_scale: atol is a fraction of max |expected|, the
    tensor's own scale (real models carry a few huge residual coordinates, SmolLM2's ~1e4, where float32
    reordering alone moves elements by more than an absolute 1e-4)."""

    rtol: float
    atol: float
    of_scale: bool = False

    def check(self, got: np.ndarray, expected: np.ndarray, what: str = "") -> None:
        atol = self.atol * max(float(np.abs(expected).max()), 1e-30) if self.of_scale else self.atol
        np.testing.assert_allclose(got, expected, rtol=self.rtol, atol=atol, err_msg=what)


FLOAT32 = Tol(1e-4, 1e-4)  # a float32 graph and its float32 reference: reordering error on the tiny models' logits


def assert_logits_equal(model: ir.Model, expected: np.ndarray, ids: np.ndarray = IDS, tol: Tol = FLOAT32,
                        extra: dict | None = None) -> np.ndarray:
    """The graph's logits on `ids` equal `expected` (a reference's: the hooked HF model, another graph) to `tol`;
    returns them."""
    got = logits(model, ids, extra)
    tol.check(got, expected, "logits")
    return got


def assert_found_tensors_equal_hooked(model: ir.Model, hf, ids: np.ndarray, logits_tol: Tol = FLOAT32, tensor_tol: Tol = FLOAT32,
                                      prepare=lambda tapped: tapped) -> tuple[dict[str, np.ndarray], list[tuple[int, str, str]]]:
    """Every tensor find_blocks names (resid_pre, attn_out, resid_mid, mlp_out, resid_post of each block), tapped
    in `model` (then `prepare`d) and run on `ids`, equals the HF model `hf`'s with forward hooks
    (tests.reference.block_tensors), and so do the logits; every hooked tensor is found. Returns the tapped values by name and the
    (layer, key, value name) of each tensor found."""
    from surgery.analysis import probe
    from surgery.model.blocks import find_blocks
    from tests.reference import block_tensors

    names = [(b.layer, key, value) for b in find_blocks(model) for key, value in b.tensors().items()]
    session = runtime.session(prepare(probe.tap(model, [value for _, _, value in names])))
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, runtime.feeds(session, ids))))
    expected_logits, expected = block_tensors(hf, ids)
    logits_tol.check(got["logits"], expected_logits, "logits")
    for layer, key, value in names:
        tensor_tol.check(got[value], expected[layer][key], f"blocks.{layer}.{key}")
    assert {key for layer, key, _ in names if layer == 0} == set(expected[0]), "every hooked tensor is found"
    return got, names


class Exported:
    """A tiny export from conftest's `tiny_export`, loaded: the ONNX graph and its HF model (eager attention) to hook.

    Each instance loads its own graph and torch model, so a module may hook or edit them; the folders are shared."""

    def __init__(self, tiny):
        from transformers import AutoModelForCausalLM

        self.folder = tiny.onnx
        self.onnx = graph.load(self.folder)
        self.torch = AutoModelForCausalLM.from_pretrained(tiny.hf, attn_implementation="eager").eval()

    def reference(self, parallel=(), branch_edits=()):
        from tests.reference import edited_logits

        return edited_logits(self.torch, IDS, parallel, branch_edits)


def linear_model() -> ir.Model:
    """x -> MatMul -> Relu -> MatMul: a graph with no normalisation or residual."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 4]))
    w = ir.Value(name="w", const_value=ir.tensor(np.eye(4, dtype=np.float32)))
    a = ir.node("MatMul", [x, w])
    r = ir.node("Relu", [a.outputs[0]])
    b = ir.node("MatMul", [r.outputs[0], w])
    g = ir.Graph([x], b.outputs, nodes=[a, r, b], initializers=[w], opset_imports={"": 18})
    return ir.Model(g, ir_version=9)
