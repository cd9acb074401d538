"""Build an mlx-lm model from a GGUF file: config from metadata, weights mapped and loaded strictly."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from akunu.errors import ModelError
from akunu.models import sharding
from akunu.models.architectures import architecture_of
from akunu.models.architectures.base import Architecture
from akunu.models.gguf_file import GGUFFile
from akunu.models.gguf_weights import GROUP_SIZE, Progress, check_supported_types, quantized_stems, read_weights
from akunu.models.shard_probe import learn_cuts


def load_gguf_model(
    gguf_file: GGUFFile, *, quantized: bool, progress: Progress | None = None, group: Any = None, shard: str = "auto"
) -> tuple[nn.Module, dict[str, Any]]:
    """The mlx-lm model for a parsed GGUF file (see `gguf_file.read_gguf`), and its mlx-lm config; with a
    distributed `group`, this rank's part of it (`sharding`), `config["sharded"]` saying how."""
    architecture = architecture_of(gguf_file)
    check_supported_types(gguf_file)
    architecture.check_names(gguf_file.tensors)
    config = architecture.build_config(gguf_file)
    model = _instantiate(config)  # its arrays are placeholders, never computed: the file's replace them
    if group is None:
        weights = _mapped(
            read_weights(gguf_file, keep_quantized=quantized, progress=progress), architecture, config, model
        )
        _quantize_like(model, weights)
    else:
        weights = _read_split(gguf_file, architecture, config, model, quantized, progress, group, shard)
    model.eval()
    _load_strictly(model, weights, gguf_file)
    mx.eval(model.parameters())
    _look_up_in_float32(model)
    return model, config


def _mapped(read: dict[str, mx.array], architecture: Architecture, config: dict[str, Any], model: nn.Module):
    weights = architecture.map_weights(read, config)
    return model.sanitize(weights) if hasattr(model, "sanitize") else weights


def _read_split(
    gguf_file: GGUFFile,
    architecture: Architecture,
    config: dict[str, Any],
    model: nn.Module,
    quantized: bool,
    progress: Progress | None,
    group: Any,
    shard: str,
) -> dict[str, mx.array]:
    """This rank's part of the weights, and `model` split to hold them (`config["sharded"]` says how); no rank
    reads (common layout, pipeline) or holds (mlx-lm's own split) the whole model."""
    read = partial(read_weights, gguf_file, keep_quantized=quantized)
    shard = sharding.chosen(model, shard)
    if shard == "tensor" and sharding.common_layout(model):  # each tensor cut to this rank's part as it is read
        share = sharding.share_for_model(model, group)
        weights = _mapped(
            read(progress=progress, part=sharding.gguf_part(share)),
            architecture,
            sharding.local_config(config, share),
            model,
        )
        _quantize_like(model, weights)
        sharding.shard_common(model, group, share)
        config["sharded"] = sharding.describe_share(share, group)
    elif shard == "tensor" and hasattr(model, "shard"):  # read a layer at a time, each cut as mlx-lm's split cuts it
        cuts = learn_cuts(lambda: _instantiate(config), lambda probe: sharding.shard(probe, group, shard))
        weights = {}
        for names, report in _by_layer(gguf_file, progress):
            weights.update(
                cuts.apply(_mapped(read(progress=report, wanted=names.__contains__), architecture, config, model))
            )
        _quantize_like(model, weights)
        config["sharded"] = sharding.shard(model, group, shard)
    else:  # pipeline: split first, so the other ranks' layers are never read (or a line saying it cannot be split)
        config["sharded"] = sharding.shard(model, group, shard)
        weights = _mapped(
            read(progress=progress, wanted=sharding.gguf_pipeline_tensors(model)), architecture, config, model
        )
        _quantize_like(model, weights)
    return weights


def _by_layer(gguf_file: GGUFFile, progress: Progress | None) -> Iterator[tuple[set[str], Progress | None]]:
    """The file's tensor names, those outside the layers first, then each layer's; with progress over them all."""
    groups: dict[int, set[str]] = {}
    for name in gguf_file.tensors:
        layer = re.match(r"blk\.(\d+)\.", name)
        groups.setdefault(int(layer.group(1)) if layer else -1, set()).add(name)
    done, total = 0, len(gguf_file.tensors)
    for _, names in sorted(groups.items()):
        report = progress and (lambda stage, count, _, done=done: progress(stage, done + count, total))
        yield names, report
        done += len(names)


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
