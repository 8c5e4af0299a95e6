"""Read-only measurements of residual dynamics, computed from ONNX graphs through ONNX Runtime.

diagnose.py runs them (diagnose() -> Diagnosis); stats.py reduces the probe's tensors inside the graph,
geometry.py is their NumPy reference, critical.py finds the mlp field's zeros, prefix.py measures prefix
sensitivity, rank.py holds Spearman's rank correlation.
"""

from surgery.diagnostics.diagnose import SECTIONS, DiagnoseSettings, Diagnosis, diagnose

__all__ = ["SECTIONS", "DiagnoseSettings", "Diagnosis", "diagnose"]
