"""Does weighting each token's row of the compensation fit by how much an error there moves the output lower KL?

    python benchmarks/weighted_fit.py --layers 7,23-29        # the default main job's 8 blocks

An error e in the final residual stream x_t moves the logits by about W' (g * P e) / rms(x_t) (RMSNorm's scale g,
P the projection off x_t), and the KL by half that under the Fisher metric Cov_p(u) of the original next-token
distribution p_t (u the rows of lm_head). Averaged over directions e that is proportional to
w_t = Var_{p_t}(g * u) / ms(x_t) = (E_p |g * u|^2 - |E_p g * u|^2) / mean(x_t^2), one number per token. A least
squares with the same metric G for every token cannot change the fix (an unconstrained multi-output fit is the
same under any fixed metric); a weight per token can. Fitted on the main job's 64 fit windows (80 calibration
windows dealt as it deals them), each block's own defect on the unmodified stream, with
compensation.fit(token_weights=...): none (today's fit), w_t, and 1 / ms(x_t) alone; scored (KL, top-1, dNLL from
the scoring graphs, evaluate.compare) on the 16 selection windows and the 8 held-out evaluation windows.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import kl_score, lm_head, smollm2

from surgery import compensation, data, graph, runtime
from surgery.blocks import find_blocks
from surgery.layers import parse_layers
from surgery.nodes import values_by_name


class Tapped:
    """The original model's logits, lm_head's input n and weight, and the final norm's input x (the last block's
    resid_post), tokens 1.. of a window."""

    def __init__(self, path):
        model = graph.load(path)
        head, self.weight = lm_head(model, path)
        self.names = ["logits", head.inputs[0].name, find_blocks(model)[-1].resid_post]
        values = values_by_name(model)
        model.graph.outputs.extend(values[name] for name in self.names[1:])
        self.session = runtime.session(model)

    def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        return tuple(a[0, 1:].astype(np.float64) for a in self.session.run(self.names, runtime.feeds(self.session, ids[None])))


def weights(tapped: Tapped, windows: data.Windows) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per window, w_t (module docstring) and 1 / ms(x_t), each scaled to mean 1 over all tokens."""
    fisher, rms = [], []
    scale = None
    for ids in windows.ids:
        logits, n, x = tapped(ids)
        ms = np.mean(x**2, axis=1)
        if scale is None:  # RMSNorm's g, from n = g * x / rms(x) by least squares per feature
            z = x / np.sqrt(ms)[:, None]
            scale = np.sum(n * z, 0) / np.sum(z * z, 0)
            u = (tapped.weight.T.astype(np.float64) * scale).astype(np.float32)  # [vocab, d_model]
            norms = np.sum(u.astype(np.float64) ** 2, 1)
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        mean = (p.astype(np.float32) @ u).astype(np.float64)
        fisher.append(np.maximum(p @ norms - np.sum(mean**2, 1), 0.0) / ms)
        rms.append(1.0 / ms)
    return [[w / np.mean(np.concatenate(ws)) for w in ws] for ws in (fisher, rms)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="7,23-29")
    args = parser.parse_args()
    folder = smollm2()
    model = graph.load(folder)
    layers = sorted(parse_layers(args.layers, 30))
    get = lambda part, count: data.windows(folder, None, seq_len=256, max_windows=count, part=part)  # noqa: E731
    fit_windows, selection = data.deal(get("calibration", 80), [64, 16], ["fit", "selection"])  # as the main job deals them
    held_out = get("evaluation", 8)
    start = time.perf_counter()
    fisher, rms = weights(Tapped(folder), fit_windows)
    spread = np.concatenate(fisher)
    print(f"weights in {time.perf_counter() - start:.0f} s; w_t: 5/50/95th percentiles {np.percentile(spread, [5, 50, 95]).round(3).tolist()}", flush=True)
    for name, w in (("unweighted", None), ("w_t = Var_p(g u) / ms(x)", fisher), ("1 / ms(x) alone", rms)):
        start = time.perf_counter()
        fits = compensation.fit(model, fit_windows, set(layers), token_weights=w)
        fixes = {l: fits[l].fix for l in layers}
        print(f"{name}: ridges {[fits[l].ridge for l in layers]}, fit {time.perf_counter() - start:.0f} s", flush=True)
        print(f"  selection: {kl_score(model, layers, fixes, selection)}", flush=True)
        print(f"  held out: {kl_score(model, layers, fixes, held_out)}", flush=True)


if __name__ == "__main__":
    main()
