"""SmolLM2-135M as people deploy it: built by the ONNX Runtime GenAI model builder (fp32), and our optimum
export run through the ORT transformers optimizer. Reads, rewrites and measures both next to the optimum export.

    python benchmarks/deployed.py [--windows 4] [--seq-len 256]     # needs pip install -e '.[export,genai]'

Prints: blocks found; loss of each graph on the same windows; dNLL of `ablate --branch mlp --mode tangential
--layers all` and `parallelize --layers 5,22,25` on each; whether the rewritten GenAI folder generates with
onnxruntime_genai the same 20 greedy tokens as HF with hooks; fused norms per block after the ORT optimizer.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import time

import onnx_ir as ir
from common import ROOT, smollm2, table

from surgery import canonical, data, evaluate, graph, ops
from surgery.blocks import branch_nodes, find_blocks
from surgery.passes import ablate, parallelize

OUT = ROOT / "out"
LAYERS = {5, 22, 25}


def hf_folder():
    """SmolLM2 as a Hugging Face folder (the builder reads safetensors), and the torch model."""
    from transformers import AutoModelForCausalLM

    from surgery.export import resolve_source

    src = resolve_source("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, attn_implementation="eager").eval()
    folder = OUT / "smollm2-hf"
    if not (folder / "config.json").is_file():
        model.save_pretrained(folder)
        for item in smollm2().iterdir():
            if item.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy2(item, folder / item.name)
    return folder, model


def fused_norms_per_block(path) -> list[int]:
    """How many of each block's normalisations the graph computes with a Skip(Simplified)LayerNormalization."""
    model = graph.load(path)
    counts = []
    for block in find_blocks(model):
        nodes = branch_nodes(model, block, "attn") | branch_nodes(model, block, "mlp")
        counts.append(sum(1 for n in nodes if n.op_type in ops.NORMS and (canonical.unfused_from(n) or "").startswith("Skip")))
    return counts


def main() -> None:
    from graphs.deployed import genai_build, genai_greedy, ort_optimize
    from tests.reference import greedy

    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()

    optimum = smollm2()
    hf, torch_model = hf_folder()
    genai = OUT / "smollm2-genai"
    start = time.perf_counter()
    if not (genai / "model.onnx").is_file():
        genai_build(hf, genai, "fp32")
    print(f"GenAI builder: {time.perf_counter() - start:.0f} s")
    windows = data.windows(optimum, seq_len=args.seq_len, max_windows=args.windows)

    rows = []
    for name, path in (("optimum export", optimum), ("GenAI builder fp32", genai)):
        model = graph.load(path)
        blocks = find_blocks(model)
        base = evaluate.perplexity(model, windows)
        tangential = evaluate.perplexity(ablate(model, "mlp", "tangential", range(len(blocks))).model, windows)
        par = evaluate.perplexity(parallelize(model, LAYERS).model, windows)
        written = ir.load(graph.resolve(path))  # the file's own ops, before load splits the fused norms
        ops_count = collections.Counter(n.op_type for n in written.graph if n.domain == ops.MS or n.op_type in ops.NORMS)
        rows.append({
            "graph": name, "blocks": f"{len(blocks)} {blocks[0].form}", "loss": f"{base.loss:.6f}",
            "dNLL mlp tangential, all": f"{tangential.loss - base.loss:+.4f}", "dNLL parallel 5,22,25": f"{par.loss - base.loss:+.4f}",
            "norm and contrib ops": ", ".join(f"{n} {op}" for op, n in sorted(ops_count.items())) or "none (decomposed RMSNorm)",
        })
    print(table(rows, list(rows[0])))

    rewritten = graph.write(parallelize(graph.load(genai), LAYERS).model, OUT / "smollm2-genai-parallel", genai).parent
    prompt = [int(t) for t in windows.ids[0, :16]]
    got = genai_greedy(rewritten, prompt, 20)
    expected = greedy(torch_model, prompt, 20, parallel=LAYERS)
    print(f"onnxruntime_genai greedy 20 tokens of the 5,22,25-parallel GenAI folder == HF with hooks: {got == expected}")

    norm_rows = []
    optimum_parallel = graph.write(parallelize(graph.load(optimum), LAYERS).model, OUT / "smollm2-parallel-5-22-25", optimum).parent
    for name, path in (("optimum export", optimum), ("parallel 5,22,25", optimum_parallel)):
        start = time.perf_counter()
        optimized = ort_optimize(path, OUT / f"{path.name}-ortopt", model_type="gpt2", level=2)
        counts = fused_norms_per_block(optimized)
        norm_rows.append({
            "graph through the ORT optimizer (gpt2, level 2)": name, "fused norms": sum(counts),
            "per block (layers 0-29)": "".join(map(str, counts)), "blocks 5, 22, 25": ", ".join(str(counts[i]) for i in sorted(LAYERS)),
            "s": f"{time.perf_counter() - start:.0f}",
        })
    for name, path in (("GenAI builder fp32", genai), ("GenAI, parallel 5,22,25", rewritten)):
        counts = fused_norms_per_block(path)
        norm_rows.append({
            "graph through the ORT optimizer (gpt2, level 2)": f"{name} (as built, no optimizer)", "fused norms": sum(counts),
            "per block (layers 0-29)": "".join(map(str, counts)), "blocks 5, 22, 25": ", ".join(str(counts[i]) for i in sorted(LAYERS)), "s": "-",
        })
    print(table(norm_rows, list(norm_rows[0])))


if __name__ == "__main__":
    main()
