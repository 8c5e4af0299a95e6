"""Measurements on ONNX Runtime: sessions, where windows run, corpora and windows, loss / KL / dNLL, latency."""
