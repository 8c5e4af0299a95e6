"""Would the compensation fit do better on W_down's input h (d_mlp features) than on the mlp output P = h W_down
(d_model features)? Both fold into W_down exactly; h has more features. SmolLM2-135M, held-out residual fraction.

    python benchmarks/fix_features.py [--layers 6,7,15,22,25,28,29] [--windows 32]

The fit graph taps W_down's input of the parallel block where W_down is MatMulNBits (for the error-aware
requantization); here it taps it on the float graph too. Windows: the first `--windows` of the main job's 64 fit
windows, alternating folds as compensation.fit deals them; per layer the ridge is chosen on fold 1 as the fit chooses
it, and the row says E|delta - fit|^2 / E|delta|^2 on fold 1 for features [A, P, 1] (today's) and [A, h, 1].
"""

from __future__ import annotations

import argparse

import numpy as np
from common import smollm2

from surgery import compensation, data, graph, runtime
from surgery.analysis import switchboard as board_graph
from surgery.analysis.fit_graph import KINDS, fit_tap
from surgery.equations import RIDGES, _choose_ridge
from surgery.passes import projection


def _any_projection(out):
    try:
        return projection.producing(out, 0, "a branch output").node
    except Exception:
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="6,7,15,22,25,28,29")
    parser.add_argument("--windows", type=int, default=32)
    args = parser.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    folder = smollm2()
    model = graph.load(folder)
    fit, _ = data.deal(data.windows(folder, part="calibration", max_windows=80), [64, 16], ["fit", "selection"])
    projection.quantized_node = _any_projection  # the fit graph taps W_o's and W_down's inputs of float blocks too
    session = runtime.session(compensation.fit_graph(model, layers=layers), runtime.Options(spinning=False))
    names = [o.name for o in session.get_outputs()]
    switches = board_graph.switches(KINDS, len(compensation.find_blocks(model)))
    sums: dict = {}
    for j in range(args.windows):
        out = dict(zip(names, session.run(names, runtime.feeds(session, fit.ids[j : j + 1], extra={board_graph.SWITCHES: switches}))))
        for layer in layers:
            a, p, delta, h = (out[fit_tap(layer, w)][0, 1:].astype(np.float64) for w in ("attn_out", "mlp_x", "delta", "down_in"))
            one = np.ones((len(a), 1))
            for name, z in (("[A, P, 1]", np.concatenate([a, p, one], 1)), ("[A, h, 1]", np.concatenate([a, h, one], 1))):
                zz, zd, dd = sums.setdefault((layer, name), [np.zeros((2, z.shape[1], z.shape[1])), np.zeros((2, z.shape[1], delta.shape[1])), np.zeros(2)])
                zz[j % 2] += z.T @ z
                zd[j % 2] += z.T @ delta
                dd[j % 2] += np.sum(delta * delta)
    print("| block | [A, P, 1] (today) | [A, h, 1] |\n|---|---|---|")
    for layer in layers:
        cells = []
        for name in ("[A, P, 1]", "[A, h, 1]"):
            zz, zd, dd = sums[(layer, name)]
            ridge, left = _choose_ridge(zz[0], zd[0], zz[1], zd[1], dd[1], RIDGES)
            cells.append(f"{left / dd[1]:.4f} (ridge {ridge:g})")
        print(f"| {layer} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
