"""The report sections read off the probe's per-window sums: deficit and diversity."""

from __future__ import annotations

import numpy as np


def deficit(probed: dict) -> dict:
    """Each layer's mean alignment a_l of attn_out's and the mlp's tangential parts, and the deficit 1 - a_l."""
    a = [s / c for s, c in zip(probed["align_sum"], probed["align_count"])]
    return {"alignment": a, "deficit": [1 - x for x in a], "mean": float(np.mean([1 - x for x in a]))}


def diversity(samples: list[list[dict]], blocks) -> dict:
    """Each block's diversity and effective rank at resid_pre, resid_mid and resid_post (means over the windows' samples), and the changes
    each branch and the whole block make to the diversity."""
    def mean(key, index, layer):
        values = [w[layer][key][index] for w in samples if key in w[layer]]
        return float(np.mean(values)) if values else None

    result = {}
    for point, key in (("pre", "resid_pre"), ("mid", "resid_mid"), ("post", "resid_post")):
        result[point] = {
            "diversity": [mean(key, 0, b.layer) for b in blocks],
            "effective_rank": [mean(key, 1, b.layer) for b in blocks],
        }
    pre, mid, post = (result[k]["diversity"] for k in ("pre", "mid", "post"))
    result["d_attn"] = [None if m is None else m - p for p, m in zip(pre, mid)]
    result["d_mlp"] = [None if m is None else q - m for m, q in zip(mid, post)]
    result["d_block"] = [q - p for p, q in zip(pre, post)]
    return result
