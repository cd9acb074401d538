"""Map GGUF architectures onto mlx-lm's own model classes (the model code is mlx-lm's).

The pipeline, per file: `architecture_of` picks the family by `general.architecture`; its
`build_config` reads llama.cpp's metadata keys (`metadata.py`) into an mlx-lm config.json-style
dict; `map_weights` renames llama.cpp's tensors (`blk.N.attn_q`, ...) onto mlx-lm's module paths
and undoes llama.cpp's layout quirks (`base.py`). One module per family.
"""

from __future__ import annotations

from akunu.errors import ModelError
from akunu.models.architectures.base import Architecture
from akunu.models.architectures.gemma import GEMMA2, GEMMA3, GEMMA4
from akunu.models.architectures.gpt_oss import GPT_OSS
from akunu.models.architectures.llama import GRANITE, LLAMA, SMOLLM3
from akunu.models.architectures.metadata import llama3_rope_divisors
from akunu.models.architectures.olmo import OLMO2
from akunu.models.architectures.phi import PHI3
from akunu.models.architectures.qwen import QWEN2, QWEN3, QWEN3MOE
from akunu.models.architectures.qwen35 import QWEN35, QWEN35MOE
from akunu.models.gguf_file import GGUFFile

SUPPORTED = {
    arch.gguf_name: arch
    for arch in (
        LLAMA,
        GRANITE,
        SMOLLM3,
        QWEN2,
        QWEN3,
        QWEN3MOE,
        QWEN35,
        QWEN35MOE,
        PHI3,
        GEMMA2,
        GEMMA3,
        GEMMA4,
        GPT_OSS,
        OLMO2,
    )
}


def architecture_of(gguf_file: GGUFFile) -> Architecture:
    name = gguf_file.architecture
    if name not in SUPPORTED:
        shown = name or "(none)"
        raise ModelError(
            f"{gguf_file.path.name} is a '{shown}' model; akunu supports the GGUF architectures: "
            + ", ".join(sorted(SUPPORTED))
        )
    return SUPPORTED[name]


__all__ = ["SUPPORTED", "Architecture", "architecture_of", "llama3_rope_divisors"]
