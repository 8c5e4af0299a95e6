"""Does a least-squares correction of the final hidden state, folded into lm_head, lower the main job's KL?

    python benchmarks/final_fix.py out/smollm2-parallel      # the default main job's output folder

The rewritten model's normalized final hidden state n' (lm_head's input) is fitted to the original model's n by
ridge least squares, n ~ [n', 1] B: float64 normal equations solved as the compensation fit solves them, the ridge
chosen on one fold of windows by the error in logits space, then refitted on both folds. logits = [n', 1] B W_lm
would fold B into lm_head at no extra cost per token (one [d_model + 1, d_model] product into a [d_model, vocab]
weight). Fitted on the main job's 64 fit windows, scored (mean token KL(original || model) and top-1 agreement over
targets 1.., in NumPy from raw ONNX Runtime logits) on its 16 selection windows and its 8 held-out evaluation
windows, before and after the correction.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import lm_head, smollm2

from surgery import data, equations, graph, runtime

RIDGES = (1e-8, 1e-6, 1e-4, 1e-2, 1.0)


class Tapped:
    """A model's session that also returns lm_head's input, and lm_head's weight [d_model, vocab]."""

    def __init__(self, path):
        model = graph.load(path)
        head, self.weight = lm_head(model, path)
        self.hidden = head.inputs[0]
        model.graph.outputs.append(self.hidden)
        self.session = runtime.session(model)

    def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, hidden = self.session.run(["logits", self.hidden.name], runtime.feeds(self.session, ids[None]))
        return logits[0, 1:], hidden[0, 1:]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def divergence(reference: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    p, q = log_softmax(reference), log_softmax(logits)
    return (np.exp(p) * (p - q)).sum(-1), p.argmax(-1) == q.argmax(-1)


def with_one(x: np.ndarray) -> np.ndarray:
    return np.concatenate([x, np.ones((len(x), 1), x.dtype)], 1).astype(np.float64)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rewritten", help="the main job's output folder")
    args = parser.parse_args()
    folder = smollm2()
    original, rewritten = Tapped(folder), Tapped(args.rewritten)
    get = lambda part, count: data.windows(folder, None, seq_len=256, max_windows=count, part=part)  # noqa: E731
    fit, selection = data.deal(get("calibration", 80), [64, 16], ["fit", "selection"])  # as the main job deals them
    held_out = get("evaluation", 8)

    clock = time.perf_counter()
    d = original.weight.shape[0]
    zz, zt = np.zeros((2, d + 1, d + 1)), np.zeros((2, d + 1, d))
    for i, ids in enumerate(fit.ids):  # two folds: even and odd windows
        z, target = with_one(rewritten(ids)[1]), original(ids)[1].astype(np.float64)
        zz[i % 2] += z.T @ z
        zt[i % 2] += z.T @ target
    gram = original.weight.astype(np.float64) @ original.weight.T.astype(np.float64)

    def held_out_error(ridge: float) -> float:  # E|(z B - n) W_lm|^2 on fold 1, up to a constant
        b = equations._ridge_solve(zz[0], zt[0], ridge)
        return float(np.trace(b.T @ zz[1] @ b @ gram) - 2 * np.trace(b.T @ zt[1] @ gram))

    ridge = min(RIDGES, key=held_out_error)
    b = equations._ridge_solve(zz.sum(0), zt.sum(0), ridge).astype(np.float32)
    head = (b[:-1] @ rewritten.weight, b[-1] @ rewritten.weight)  # the folded lm_head: weight and bias
    print(f"fitted on {len(fit)} windows in {time.perf_counter() - clock:.0f} s, ridge {ridge:g}")

    for name, windows in (("selection", selection), ("held-out evaluation", held_out)):
        before, after = [], []
        for ids in windows.ids:
            reference = original(ids)[0]
            logits, hidden = rewritten(ids)
            before.append(divergence(reference, logits))
            after.append(divergence(reference, hidden @ head[0] + head[1]))
        (kl0, top0), (kl1, top1) = ([np.concatenate(part) for part in zip(*rows)] for rows in (before, after))
        print(f"{name} ({len(windows)} windows, {kl0.size} tokens): KL {kl0.mean():.4f} -> {kl1.mean():.4f}, "
              f"top-1 {100 * top0.mean():.1f} % -> {100 * top1.mean():.1f} %")


if __name__ == "__main__":
    main()
