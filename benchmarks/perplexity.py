"""ONNX Runtime perplexity vs the HF torch model on the same SmolLM2-135M windows: loss difference and wall time.

    python benchmarks/perplexity.py [--windows 16] [--seq-len 256] [--batch-size 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from common import smollm2, table
from transformers import AutoModelForCausalLM

from surgery import data, evaluate
from surgery.export import resolve_source


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args()

    folder = smollm2()
    windows = data.windows(folder, seq_len=args.seq_len, max_windows=args.windows)
    ort_result = evaluate.perplexity(folder, windows, batch_size=args.batch_size)

    src = resolve_source("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file).eval()
    start = time.perf_counter()
    total = 0.0
    with torch.no_grad():
        for lo in range(0, len(windows), args.batch_size):
            ids = torch.from_numpy(windows.ids[lo : lo + args.batch_size])
            logits = model(input_ids=ids).logits.float()
            logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
            total -= float(logp.gather(-1, ids[:, 1:, None]).sum())
    torch_seconds = time.perf_counter() - start
    torch_loss = total / windows.tokens

    rows = [
        {"engine": "ONNX Runtime (CPU)", "loss": f"{ort_result.loss:.6f}", "seconds": f"{ort_result.seconds:.2f}"},
        {"engine": f"torch {torch.__version__} (eager)", "loss": f"{torch_loss:.6f}", "seconds": f"{torch_seconds:.2f}"},
    ]
    print(f"{windows.name}: {len(windows)} windows x {args.seq_len} tokens, {windows.tokens} scored, batch {args.batch_size}, "
          f"{torch.get_num_threads()} torch threads")
    print(table(rows, ["engine", "loss", "seconds"]))
    print(f"\nloss difference ORT - torch: {ort_result.loss - torch_loss:+.2e} nats; "
          f"wall time torch / ORT: {torch_seconds / ort_result.seconds:.2f}x (scoring only; session creation and model loading excluded)")
    np.testing.assert_allclose(ort_result.loss, torch_loss, atol=1e-3)


if __name__ == "__main__":
    main()
