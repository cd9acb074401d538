"""Build an mlx-lm model from a GGUF file: config from metadata, weights mapped and loaded strictly."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from akunu.errors import ModelError
from akunu.models import sharding
from akunu.models.architectures import architecture_of
from akunu.models.gguf_file import GGUFFile
from akunu.models.gguf_weights import GROUP_SIZE, Progress, check_supported_types, quantized_stems, read_weights


def load_gguf_model(
    gguf_file: GGUFFile, *, quantized: bool, progress: Progress | None = None, group: Any = None, shard: str = "tensor"
) -> tuple[nn.Module, dict[str, Any]]:
    """The mlx-lm model for a parsed GGUF file (see `gguf_file.read_gguf`), and its mlx-lm config; with a
    distributed `group`, this rank's part of it (`sharding`), `config["sharded"]` saying how."""
    architecture = architecture_of(gguf_file)
    check_supported_types(gguf_file)
    architecture.check_names(gguf_file.tensors)
    config = architecture.build_config(gguf_file)
    model = _instantiate(config)  # its arrays are placeholders, never computed: the file's replace them
    share, wanted = None, None
    if group is not None and shard == "tensor" and sharding.common_layout(model):
        share = sharding.share_for_model(model, group)  # each tensor cut to this rank's part as it is read
    elif group is not None and shard == "pipeline":  # split first: the other ranks' layers are never read
        config["sharded"] = sharding.shard(model, group, shard)
        wanted = sharding.gguf_pipeline_tensors(model)
    part = sharding.gguf_part(share) if share else None
    read = read_weights(gguf_file, keep_quantized=quantized, progress=progress, part=part, wanted=wanted)
    weights = architecture.map_weights(read, sharding.local_config(config, share) if share else config)
    weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights
    _quantize_like(model, weights)
    if share:
        sharding.shard_common(model, group, share)
        config["sharded"] = sharding.describe_share(share, group)
    model.eval()
    _load_strictly(model, weights, gguf_file)
    if group is not None and "sharded" not in config:  # whole tensors read first: mlx-lm's tensor split
        config["sharded"] = sharding.shard(model, group, shard)
    mx.eval(model.parameters())
    _look_up_in_float32(model)
    return model, config


def _load_strictly(model: nn.Module, weights: dict[str, mx.array], gguf_file: GGUFFile) -> None:
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as error:
        layout = f"the {gguf_file.architecture} layout"
        raise ModelError(f"{gguf_file.path.name}: weights do not match {layout} ({_first_line(error)})") from None


def _instantiate(config: dict[str, Any]) -> nn.Module:
    # mlx-lm's public layout: one module per model type, each with its Model and ModelArgs.
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return module.Model(module.ModelArgs.from_dict(config))


def _quantize_like(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Swap each Linear/Embedding whose weight arrives quantized for its quantized twin, bits per layer."""
    bits_by_path = quantized_stems(weights)
    if not bits_by_path:
        return

    def predicate(path: str, module: nn.Module) -> bool | dict[str, int]:
        if path not in bits_by_path or not hasattr(module, "to_quantized"):
            return False
        return {"group_size": GROUP_SIZE, "bits": bits_by_path[path]}

    nn.quantize(model, group_size=GROUP_SIZE, bits=4, class_predicate=predicate)


class Float32Lookup(nn.QuantizedEmbedding):
    """A quantized embedding holding float16 scales that looks rows up in float32 (the same exact values:
    float16 rows would make float16 activations)."""

    def __call__(self, x: mx.array) -> mx.array:
        scales, biases = (self[name][x].astype(mx.float32) for name in ("scales", "biases"))
        return mx.dequantize(self["weight"][x], scales, biases, group_size=self.group_size, bits=self.bits)


def _look_up_in_float32(model: nn.Module) -> None:
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedEmbedding and module["scales"].dtype != mx.float32:
            module.__class__ = Float32Lookup


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
