"""Split a model across the ranks of an MLX distributed group: tensor parallel, or pipeline parallel.

Tensor parallel, for the common layout (attention with q/k/v/o projections, a gated MLP; llama, qwen2,
qwen3, gemma3, mistral...): each rank keeps whole KV-head groups (with their query heads) and a slice of
the MLP, so a layer ends in two all-sums (attention output, MLP down projection). Ranks may hold unequal
shares (SmolLM2's 3 KV heads over 2 ranks: 2 and 1), which mlx-lm's own `shard()` does not allow. The q, k,
v, gate and up projections stay the Linear or QuantizedLinear they were, so the CPU backend's kernels still
run them; the two summing products are mlx's ShardedToAllLinear. Other architectures with an mlx-lm
`shard()` (MoE, hybrids) use it (a GGUF file is then cut as `shard_probe` learns it cuts); those with
mlx-lm's pipeline support can run pipeline parallel instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from akunu.errors import ModelError

SHARDINGS = ("auto", "tensor", "pipeline")
# GGUF tensor stems of the common layout -> (mlx-lm projection, whether its rows (outputs) or columns are split)
GGUF_PROJECTIONS = {
    "attn_q": ("q_proj", "rows"),
    "attn_k": ("k_proj", "rows"),
    "attn_v": ("v_proj", "rows"),
    "attn_output": ("o_proj", "columns"),
    "ffn_gate": ("gate_proj", "rows"),
    "ffn_up": ("up_proj", "rows"),
    "ffn_down": ("down_proj", "columns"),
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Share:
    """One rank's part of every layer: its query heads, KV heads and MLP rows (start, stop), and the head size."""

    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]
    head_dim: int
    widths: tuple[int, int]  # the unsplit inputs of o_proj and down_proj (all heads, the whole MLP)

    def columns(self, projection: str) -> int:
        return self.widths[0] if projection == "o_proj" else self.widths[1]

    def span(self, projection: str) -> tuple[int, int]:
        """The rows (q/k/v/gate/up) or columns (o/down) of `projection` this rank keeps."""
        if projection in ("q_proj", "o_proj"):
            return self.heads[0] * self.head_dim, self.heads[1] * self.head_dim
        if projection in ("k_proj", "v_proj"):
            return self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim
        return self.ffn


def share_of(heads: int, kv_heads: int, head_dim: int, ffn: int, rank: int, size: int) -> Share:
    """Rank `rank`'s share: whole KV groups (as even as they go) and MLP rows in whole quantization groups."""
    if kv_heads < size or heads % kv_heads:
        raise ModelError(f"{kv_heads} KV heads cannot be split across {size} ranks (one at least each)")
    kv = _even(kv_heads, size)[rank]
    per_kv = heads // kv_heads
    unit = next(u for u in (64, 32, 1) if ffn % u == 0 and ffn // u >= size)  # whole quantization groups
    rows = _even(ffn // unit, size)[rank]
    return Share(
        (kv[0] * per_kv, kv[1] * per_kv), kv, (rows[0] * unit, rows[1] * unit), head_dim, (heads * head_dim, ffn)
    )


def _even(count: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(count, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + base + (part < extra))
    return list(zip(bounds, bounds[1:]))


def common_layout(model: nn.Module) -> bool:
    """Whether every layer has the q/k/v/o attention and gated MLP that `shard_common` splits."""
    layers = getattr(model, "layers", None)
    if not layers:
        return False
    for layer in layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        modules = [getattr(attention, name, None) for name in ATTENTION] + [getattr(mlp, name, None) for name in MLP]
        if not all(type(m) in (nn.Linear, nn.QuantizedLinear) for m in modules):
            return False
        if not (hasattr(attention, "n_heads") and hasattr(attention, "n_kv_heads")):
            return False
    return True


def share_for_model(model: nn.Module, group: Any) -> Share:
    attention, mlp = model.layers[0].self_attn, model.layers[0].mlp
    head_dim = _outputs(attention.q_proj) // attention.n_heads
    ffn = _outputs(mlp.gate_proj)
    return share_of(attention.n_heads, attention.n_kv_heads, head_dim, ffn, group.rank(), group.size())


def _outputs(linear: nn.Module) -> int:
    return int(linear["weight"].shape[0])


def shard_common(model: nn.Module, group: Any, share: Share, *, sliced: bool = False) -> None:
    """Split every layer as `share` says; with `sliced`, the weights to load are already the rank's part,
    so only the layers' shapes change (their current arrays are placeholders)."""
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for owner, names in ((attention, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
            for name in names:
                _keep_rows(owner[name], share.span(name))
        attention.o_proj = _summing(attention.o_proj, share.span("o_proj"), group)
        mlp.down_proj = _summing(mlp.down_proj, share.span("down_proj"), group)
        attention.n_heads = share.heads[1] - share.heads[0]
        attention.n_kv_heads = share.kv_heads[1] - share.kv_heads[0]
        if hasattr(attention, "repeats"):
            attention.repeats = attention.n_heads // attention.n_kv_heads
    del sliced  # shapes are what matter: load_weights replaces the arrays either way


def _keep_rows(linear: nn.Module, span: tuple[int, int]) -> None:
    start, stop = span
    for name in ("weight", "scales", "biases", "bias"):
        if name in linear:
            linear[name] = linear[name][start:stop]


def _summing(linear: nn.Module, span: tuple[int, int], group: Any) -> nn.Module:
    """A ShardedToAllLinear holding `span` of the layer's input columns (its bias is added once, after the sum)."""
    start, stop = span
    has_bias = "bias" in linear
    if type(linear) is nn.QuantizedLinear and (start % linear.group_size or stop % linear.group_size):
        raise ModelError(f"a share of columns {start}-{stop} splits a quantization group of {linear.group_size}")
    if type(linear) is nn.Linear:
        summed = nn.ShardedToAllLinear(stop - start, 1, bias=False, group=_Single(group))
        summed.weight = linear["weight"][:, start:stop]
    else:
        per_word = 32 // linear.bits
        summed = nn.QuantizedShardedToAllLinear(
            stop - start, 1, bias=False, group_size=linear.group_size, bits=linear.bits, group=_Single(group)
        )
        summed.weight = linear["weight"][:, start // per_word : stop // per_word]
        summed.scales = linear["scales"][:, start // linear.group_size : stop // linear.group_size]
        summed.biases = linear["biases"][:, start // linear.group_size : stop // linear.group_size]
    if has_bias:
        summed.bias = linear["bias"]
    summed.group = group
    return summed


class _Single:
    """A one-rank stand-in while building: mlx's constructors check that the columns divide by the group size."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def gguf_part(share: Share) -> Callable[[str], tuple | None]:
    """For a GGUF read: the (rows, columns) of each common-layout tensor this rank keeps (None: all of it),
    so no rank decodes, or holds, the whole model."""

    def part(name: str) -> tuple | None:
        match = re.fullmatch(r"blk\.\d+\.(\w+)\.(weight|bias)", name)
        if not match or match.group(1) not in GGUF_PROJECTIONS:
            return None
        projection, axis = GGUF_PROJECTIONS[match.group(1)]
        span = share.span(projection)
        if match.group(2) == "bias":  # a row split's bias is split with its rows; a column split's is whole
            return (None, span) if axis == "rows" else None
        return (span, None) if axis == "rows" else (None, span)

    return part


def gguf_pipeline_tensors(model: nn.Module) -> Callable[[str], bool]:
    """For a GGUF read after `shard(model, group, "pipeline")`: whether this rank reads a tensor, i.e. its own
    layers' `blk.N.*` and every tensor outside the layers (mlx-lm's pipelined forward runs the embedding,
    final norm and output on every rank)."""
    inner = model.model

    def wanted(name: str) -> bool:
        layer = re.match(r"blk\.(\d+)\.", name)
        return layer is None or inner.start_idx <= int(layer.group(1)) < inner.end_idx

    return wanted


def local_config(config: dict[str, Any], share: Share) -> dict[str, Any]:
    """The config GGUF layout fixes see for the rank's part (its head counts: Q/K rows are unpermuted per head)."""
    return {
        **config,
        "num_attention_heads": share.heads[1] - share.heads[0],
        "num_key_value_heads": share.kv_heads[1] - share.kv_heads[0],
    }


def describe_share(share: Share, group: Any) -> str:
    return (
        f"tensor parallel over {group.size()} ranks; rank {group.rank()} holds query heads "
        f"{share.heads[0]}-{share.heads[1] - 1} and MLP rows {share.ffn[0]}-{share.ffn[1] - 1}"
    )


def chosen(model: nn.Module, how: str) -> str:
    """`how`, or for "auto": tensor where the architecture has a tensor split (every rank in every pass), else
    pipeline."""
    if how != "auto":
        return how
    return "tensor" if common_layout(model) or hasattr(model, "shard") else "pipeline"


def shard(model: nn.Module, group: Any, how: str) -> str:
    """Split a loaded (or lazily loaded) model across `group`; a line saying how. A ModelError if it cannot be."""
    how = chosen(model, how)
    architecture = getattr(getattr(model, "args", None), "model_type", type(model).__module__.rsplit(".", 1)[-1])
    if how == "tensor" and common_layout(model):
        share = share_for_model(model, group)
        shard_common(model, group, share)
        return describe_share(share, group)
    if how == "tensor" and hasattr(model, "shard"):
        try:
            model.shard(group)
        except (AssertionError, ValueError) as error:  # mlx-lm's checks that the sizes divide
            raise ModelError(f"mlx-lm cannot split {architecture} across {group.size()} ranks: {error}") from None
        return f"tensor parallel over {group.size()} ranks (mlx-lm's {architecture} split)"
    if how == "pipeline" and hasattr(getattr(model, "model", None), "pipeline"):
        model.model.pipeline(group)
        inner = model.model
        return (
            f"pipeline parallel over {group.size()} ranks: this rank runs layers {inner.start_idx}-{inner.end_idx - 1}"
        )
    tensor = common_layout(model) or hasattr(model, "shard")
    if how == "pipeline" and tensor:
        raise ModelError(f"{architecture} has no pipeline split in mlx-lm; --shard tensor splits it")
    if how == "tensor" and hasattr(getattr(model, "model", None), "pipeline"):
        raise ModelError(f"{architecture} has no tensor split; --shard pipeline splits it")
    raise ModelError(f"{architecture} can be split across machines neither by tensor nor by pipeline: run it on one")
