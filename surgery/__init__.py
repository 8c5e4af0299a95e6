"""surgery: find, rewrite and measure the transformer blocks of exported ONNX language models."""

__version__ = "0.1.0"
