"""akunu: local LLM inference on MLX with n-gram speculative decoding."""

from akunu import backends

__version__ = "0.1.0"

# An optimized BLAS must be in the process before MLX is first imported (Linux CPU backend).
backends.preload()
