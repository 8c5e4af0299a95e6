"""Where graphs run: ONNX Runtime sessions (runtime: CUDA when it works, CPU otherwise), windows spread over Ray actors
or this process (cluster), and the progress callbacks every long step reports through (progress)."""
