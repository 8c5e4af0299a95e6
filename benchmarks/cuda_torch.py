"""The block forms in PyTorch at benchmarks/cuda.py's shapes (issue 36, item 2): what each form allows on the GPU, eager
and as CUDA-graph replay, beside what ONNX Runtime realises of it (cuda.py's table).

    python benchmarks/cuda_torch.py [--shape 1b|8b] [--dtype float16] [--batches 1,8,32] [--seq-len 512]
                                    [--repeats 20] [--warmup 5] [--layers "half;all"]
    python benchmarks/cuda_torch.py --smoke    # CPU, a tiny float32 model, eager only: checks the script, measures nothing

The weights are those of cuda.py's synthetic decoder (written once to out/llama-<shape>-random-<dtype>; built there if
missing), read from the ONNX graph by initializer name, so each form computes what surgery's graph of that form computes
(tests/test_runtime.py checks the logits of original, plain and fused against ONNX Runtime on the CPU). Forms, at each
block set of --layers (`half`: the later half of the blocks, `all`, or a layer list):

    original      h = x + A(ln1 x); out = h + M(ln2 h)
    plain         out = x + A(ln1 x) + M(ln2 x): the parallel form with the graph's kernels
    fused         one RMS normalisation (the gains folded into the weights), one input MatMul [Wq Wk Wv Wgate Wup],
                  one output MatMul [Wo; Wdown]: surgery's fused form
    two streams   plain, with A and M launched on two CUDA streams (CUDA only): branches that overlap

The compensated graphs have the kernels of these forms (the fix is folded into W_o, W_down and the mlp's input) and a
bias Add; they are not repeated here. Attention is torch's scaled_dot_product_attention (the flash kernel on a GPU),
as a server would run it. Prefill is batch x --seq-len tokens from an empty cache, decode one token per sequence
after a cache of --seq-len; each form's runs are timed with the other forms' interleaved (surgery.measure.timing.interleaved),
eager and replayed from a torch.cuda.CUDAGraph captured once. One table of median [p90] ms and ratios to $OUT / stdout.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from common import ROOT, SHAPES, TINY, block_sets, gpu_name, table, written

from surgery.files import graph
from surgery.measure import timing
from surgery.model.layers import format_layers

FORMS = ("original", "plain", "fused", "two streams")


class Twin:
    """cuda.py's Llama-shaped decoder in PyTorch, its weights read from the graph; forward(ids, past, form, layers)."""

    def __init__(self, model, shape: dict, device: str):
        w = {name: torch.tensor(v.const_value.numpy(), device=device) for name, v in model.graph.initializers.items()}
        self.shape, self.w, self.n = shape, w, shape["n_layers"]
        self.d_head = shape["d_model"] // shape["n_heads"]
        self.eps = float(w["eps"])
        self.fused_in, self.fused_out = {}, {}  # per layer, made on first use: gains folded into the input MatMul
        self.side = torch.cuda.Stream() if device == "cuda" else None

    def _fused(self, l: int):
        if l not in self.fused_in:
            w, g1, g2 = self.w, self.w[f"ln1.{l}"][:, None], self.w[f"ln2.{l}"][:, None]
            self.fused_in[l] = torch.cat([g1 * w[f"q.{l}"], g1 * w[f"k.{l}"], g1 * w[f"v.{l}"], g2 * w[f"gate.{l}"], g2 * w[f"up.{l}"]], 1)
            self.fused_out[l] = torch.cat([w[f"o.{l}"], w[f"down.{l}"]], 0)
        return self.fused_in[l], self.fused_out[l]

    def rms(self, x, gain=None):
        x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)
        return x if gain is None else x * gain

    def attention(self, q, k, v, past, positions):
        """q, k, v: [batch, seq, width] projections; past: (key, value) [batch, kv, T, d_head] or None. -> merged heads, (key, value)"""
        b, s, _ = q.shape
        cos, sin = self.w["rope.cos"][positions][:, None], self.w["rope.sin"][positions][:, None]

        def heads(t):
            return t.view(b, s, -1, self.d_head).transpose(1, 2)

        def rotate(t):
            t1, t2 = t.chunk(2, -1)
            return t * cos + torch.cat([-t2, t1], -1) * sin

        q, k, v = rotate(heads(q)), rotate(heads(k)), heads(v)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=past is None, enable_gqa=True)
        return mixed.transpose(1, 2).reshape(b, s, -1), (k, v)

    def attn(self, l, a, past, positions):
        """The attention branch on a (normalised): its output and the present."""
        w = self.w
        mixed, present = self.attention(a @ w[f"q.{l}"], a @ w[f"k.{l}"], a @ w[f"v.{l}"], past, positions)
        return mixed @ w[f"o.{l}"], present

    def mlp(self, l, m):
        w = self.w
        return (F.silu(m @ w[f"gate.{l}"]) * (m @ w[f"up.{l}"])) @ w[f"down.{l}"]

    def block(self, l, x, past, positions, form):
        w = self.w
        if form == "original":
            attn, present = self.attn(l, self.rms(x, w[f"ln1.{l}"]), past, positions)
            h = x + attn
            return h + self.mlp(l, self.rms(h, w[f"ln2.{l}"])), present
        if form == "plain":
            attn, present = self.attn(l, self.rms(x, w[f"ln1.{l}"]), past, positions)
            return x + attn + self.mlp(l, self.rms(x, w[f"ln2.{l}"])), present
        if form == "two streams":
            main = torch.cuda.current_stream()
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                mlp = self.mlp(l, self.rms(x, w[f"ln2.{l}"]))
            attn, present = self.attn(l, self.rms(x, w[f"ln1.{l}"]), past, positions)
            main.wait_stream(self.side)
            if not torch.cuda.is_current_stream_capturing():  # a captured graph's pool keeps its own tensors
                mlp.record_stream(main)
            return x + attn + mlp, present
        if form == "fused":
            w_in, w_out = self._fused(l)
            d, kv = self.shape["d_model"], self.shape["n_kv_heads"] * self.d_head
            q, k, v, gate, up = (self.rms(x) @ w_in).split([d, kv, kv, self.shape["d_mlp"], self.shape["d_mlp"]], -1)
            mixed, present = self.attention(q, k, v, past, positions)
            return x + torch.cat([mixed, F.silu(gate) * up], -1) @ w_out, present
        raise ValueError(f"unknown form {form!r}; use one of {', '.join(FORMS)}")

    def forward(self, ids, past, form: str, layers) -> tuple[torch.Tensor, list]:
        """Logits and the present of every layer; the blocks in `layers` in `form`, the others original."""
        start = 0 if past is None else past[0][0].shape[2]
        positions = torch.arange(start, start + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        x, presents = self.w["embed_tokens"][ids], []
        for l in range(self.n):
            x, present = self.block(l, x, None if past is None else past[l], positions, form if l in layers else "original")
            presents.append(present)
        return self.rms(x, self.w["ln_f.0"]) @ self.w["lm_head"], presents


def runs(twin: Twin, form: str, layers, ids, next_ids, replay: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """One form's prefill and decode on static inputs, eager or replayed from CUDA graphs captured once; the decode's
    cache is this form's own present."""
    with torch.inference_mode():
        _, past = twin.forward(ids, None, form, layers)
    steps = (lambda: twin.forward(ids, None, form, layers), lambda: twin.forward(next_ids, past, form, layers))
    prefill, decode = (_captured(step) if replay else _eager(step) for step in steps)
    return prefill, decode


def _eager(step):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def run():
        with torch.inference_mode():
            step()
        sync()

    return run


def _captured(step):
    """torch's recipe: warm up on a side stream, capture once, replay (outputs land in the graph's own pool)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(cuda_graph):
        step()

    def run():
        cuda_graph.replay()
        torch.cuda.synchronize()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--seq-len", type=int, default=512, help="prefill length, and the decode's cache")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", default="half;all", help="`;`-separated block sets: half (the later half), all, or a layer list")
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny float32 model, seq-len 32, 3 repeats, eager only")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks/cuda_torch.py needs an NVIDIA GPU that torch can use; `--smoke` checks the script on CPU", file=sys.stderr)
        sys.exit(1)
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.dtype, args.seq_len, args.repeats, args.warmup = "float32", 32, 3, 1
    shape = {**(TINY if args.smoke else SHAPES[args.shape]), "dtype": args.dtype}
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:  # the smoke test's tiny model is written there; the real one is kept in out/
        where = Path(tmp) / "tiny" if args.smoke else ROOT / "out" / f"llama-{args.shape}-random-{args.dtype}"
        twin = Twin(graph.load(written(where, shape)), shape, device)
    label = f"Llama-shaped d{shape['d_model']} x{shape['n_layers']} {args.dtype} (random)"
    log(f"{label}: weights on {device} in {time.perf_counter() - start:.0f} s")
    forms = [f for f in FORMS if device == "cuda" or f != "two streams"]
    ways = ("eager",) if args.smoke else ("eager", "CUDA graph")
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    for layers in block_sets(args.layers, shape["n_layers"]):
        blocks = format_layers(layers)
        for way in ways:
            cells: dict[str, dict] = {f: {} for f in forms}
            for batch in batches:
                start = time.perf_counter()
                ids = torch.from_numpy(rng.integers(0, shape["vocab"], (batch, args.seq_len))).to(device)
                next_ids = torch.from_numpy(rng.integers(0, shape["vocab"], (batch, 1))).to(device)
                made, failed = [], {}
                for f in forms:
                    try:
                        made.append(runs(twin, f, layers, ids, next_ids, replay=way != "eager"))
                    except Exception as e:  # noqa: BLE001 - a form torch cannot capture is a finding: its cells say why
                        made.append((None, None))
                        failed[f] = f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:100] if str(e).strip() else ''}"
                        log(f"{label}, blocks {blocks}: {way}: {f}: {failed[f]}")
                prefills, decodes = zip(*made, strict=True)
                for run in prefills + decodes:
                    for _ in range(args.warmup if run else 0):
                        run()
                times = timing.interleaved([prefills, decodes], args.repeats)
                for kind, per_form in zip(("prefill", "decode"), times, strict=True):
                    base = np.median(per_form[0]) if per_form[0] else np.nan
                    for f, t in zip(forms, per_form, strict=True):
                        cells[f][f"{kind} b{batch} ms (x)"] = failed.get(f) or f"{np.median(t):.3f} [{np.percentile(t, 90):.3f}] ({base / np.median(t):.3f})"
                del made, prefills, decodes  # their CUDA graphs' memory pools
                log(f"{label}, blocks {blocks}: {way}: batch {batch} timed in {time.perf_counter() - start:.0f} s")
                if device == "cuda":
                    torch.cuda.empty_cache()
            more = [{"model": label, "form": f, "torch": way, "blocks": "-" if f == "original" else f"{len(layers)}: {blocks}", **cells[f]} for f in forms]
            log(table(more, list(more[0])))  # in the log as each block set and way ends: a run stopped later keeps these
            rows += more
    columns = ["model", "form", "torch", "blocks"] + [f"{k} b{b} ms (x)" for b in batches for k in ("prefill", "decode")]
    print(f"torch {torch.__version__}, {'CPU smoke test, not a measurement' if args.smoke else gpu_name()}, {args.repeats} interleaved repeats "
          f"(warm-up {args.warmup}), prefill batch x {args.seq_len}, decode 1 token after a cache of {args.seq_len}")
    print(table(rows, columns))
    print("\nms = median [p90]; x = original median / this form's median (> 1 is faster), from one interleaved run per block set, way and batch")


if __name__ == "__main__":
    main()
