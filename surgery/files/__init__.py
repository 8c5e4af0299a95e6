"""Files: ONNX graphs read, checked, put in their plain view and written whole; config, metadata, export, checkpoints."""
