"""The tiny models akunu's CPU kernels run whole, and each as the loader applies the CPU backend to it."""

import pytest

from akunu import backends
from akunu.backends.cpu import quantized
from tests.tiny import quantize, tiny_llama, tiny_qwen2

MODELS = {
    "llama": lambda: tiny_llama(hidden=64, seed=4),  # one layer stack of float32 products; heads of 16 dimensions
    "qwen2 quantized, with biases": lambda: quantize(tiny_qwen2(seed=4)),  # quantized products: v at 8 bits, q, k at 4
    "qwen2 with biases": lambda: tiny_qwen2(seed=4),  # a traced pass around attention nodes
}


def applied(name: str):
    """MODELS[name] with akunu's CPU backend, as the loader applies it: fused layers, quantized layers on the kernel."""
    if "quantized" in name and quantized.load() is None:
        pytest.skip(f"no quantized kernel here: {quantized.unavailable()}")
    model = MODELS[name]()
    backends.apply(model)
    return model
