"""surgery's version: the one place it is written (pyproject.toml reads it), in a leaf module so that a stage that
records it (checkpoints, the model's history, diagnose's report) imports nothing above itself."""

__version__ = "0.1.0"
