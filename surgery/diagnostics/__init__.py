"""Read-only measurements of residual dynamics, computed from ONNX graphs through ONNX Runtime."""

from surgery.diagnostics.diagnose import SECTIONS, Diagnosis, diagnose

__all__ = ["SECTIONS", "Diagnosis", "diagnose"]
