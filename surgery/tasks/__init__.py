"""Downstream tasks as lm-eval defines them: the task table (catalog), log-likelihoods of (context, continuation)
pairs on ONNX Runtime (likelihood), accuracy with paired intervals (accuracy), and lm-eval's own model API on a
graph (harness)."""
