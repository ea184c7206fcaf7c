"""``initialize``: the one entry point that checks the config before any process group starts,
builds the DeepSpeed engine, the data stream and the adaptive engine, and wires the capabilities the
config asks for (memory, noise, live elasticity, checkpoints)."""

from .build import initialize

__all__ = ["initialize"]
