"""The model as read: its blocks (BlockMap), a Subject read once per command, its facts, nodes and quantized weights."""
