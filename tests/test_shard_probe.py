"""A GGUF model split by mlx-lm's own `shard()` (MoE, hybrids) is cut as it is read, a layer at a time: each
rank's weights are bit for bit those of the whole model split after loading, and no rank holds the whole model.

One process plays each rank: the split needs only the group's size and rank (its sums run when the model does).
Also: which split `--shard auto` picks.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants
from mlx.utils import tree_flatten

from akunu.errors import ModelError
from akunu.models import sharding
from akunu.models.gguf_file import read_gguf
from akunu.models.gguf_model import load_gguf_model
from tests import llama_cpp_tiny as tiny


class PlayedRank:
    def __init__(self, rank: int, size: int = 2) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def whole_then_split(path: Path, quantized: bool, group: PlayedRank):
    model, _ = load_gguf_model(read_gguf(path), quantized=quantized)
    sharding.shard(model, group, "tensor")
    mx.eval(model.parameters())
    return model


def qwen3moe(experts: int, ffn: int, layers: int = 2) -> tiny.TinyArch:
    """A tiny qwen3moe with more or wider experts than llama_cpp_tiny's."""
    moe = {
        "ffn_gate_inp": (experts, tiny.HIDDEN),
        "ffn_gate_exps": (experts, ffn, tiny.HIDDEN),
        "ffn_up_exps": (experts, ffn, tiny.HIDDEN),
        "ffn_down_exps": (experts, tiny.HIDDEN, ffn),
    }
    keys = {"expert_count": experts, "expert_used_count": 2, "expert_feed_forward_length": ffn}
    layer = {**tiny.ATTENTION, **tiny.NORMS, **tiny.QK_NORMS, **moe}
    return tiny.TinyArch(f"qwen3moe-{experts}x{ffn}", "qwen3moe", layer, layers=layers, keys=keys)


@pytest.mark.parametrize(
    "arch, matrices, quantized",
    [
        ("qwen3moe", "q8_0", True),
        ("qwen35", "q8_0", True),
        ("qwen35moe", "float32", False),
        ("gpt-oss", "q8_0", True),
    ],
)
def test_each_rank_reads_what_the_whole_model_split_after_loading_holds(tmp_path, arch, matrices, quantized):
    path = tiny.write(tiny.ARCHS[arch], tmp_path / f"{arch}.gguf", matrices=matrices)
    for rank in (0, 1):
        split, config = load_gguf_model(read_gguf(path), quantized=quantized, group=PlayedRank(rank))
        assert "mlx-lm's" in config["sharded"]
        expected = whole_then_split(path, quantized, PlayedRank(rank))
        got, wanted = dict(tree_flatten(split.parameters())), dict(tree_flatten(expected.parameters()))
        assert got.keys() == wanted.keys()
        for name, array in wanted.items():
            assert got[name].dtype == array.dtype and mx.array_equal(got[name], array).item(), (rank, name)
        for (name, module), (_, twin) in zip(split.named_modules(), expected.named_modules(), strict=True):
            assert type(module) is type(twin), name


def test_quantized_expert_stacks_are_cut_by_whole_groups(tmp_path):
    """Q5_0 expert stacks (five 32-bit words per 32 weights) split along their rows and their columns."""
    arch = qwen3moe(experts=4, ffn=64)
    path = tmp_path / "moe.gguf"
    writer = GGUFWriter(str(path), "qwen3moe")
    tiny._add_hyperparameters(writer, arch)
    tiny._add_tokenizer(writer)
    for name, values in tiny._tensors(arch, np.random.default_rng(0)).items():
        if "_exps." in name:
            writer.add_tensor(name, quants.quantize(values, Q.Q5_0), raw_dtype=Q.Q5_0)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for rank in (0, 1):
        split, _ = load_gguf_model(read_gguf(path), quantized=True, group=PlayedRank(rank))
        got, wanted = (
            dict(tree_flatten(split.parameters())),
            dict(tree_flatten(whole_then_split(path, True, PlayedRank(rank)).parameters())),
        )
        stacks = [name for name in wanted if ".switch_mlp." in name and name.endswith(".weight")]
        assert stacks and all(got[name].dtype == mx.uint32 for name in stacks)
        assert all(mx.array_equal(got[name], array).item() for name, array in wanted.items()), rank


def test_no_rank_holds_the_whole_of_a_split_moe_model(tmp_path):
    """8 layers of 64 experts (3 MB per expert stack): a rank's peak is its half plus about one layer."""
    path = tiny.write(qwen3moe(experts=64, ffn=192, layers=8), tmp_path / "moe.gguf")
    whole = sum(info.nbytes for info in read_gguf(path).tensors.values())
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()  # what earlier tests in this process still hold
    model, _ = load_gguf_model(read_gguf(path), quantized=False, group=PlayedRank(0))
    peak = mx.get_peak_memory() - before
    held = sum(array.nbytes for _, array in tree_flatten(model.parameters()))
    assert held < 0.55 * whole
    assert peak < held + 0.2 * whole < whole, (peak, held, whole)


def test_a_split_through_quantization_groups_is_refused_in_one_line(tmp_path):
    """The tiny qwen35moe's shared expert is 32 wide: half of it is half a quantization group."""
    path = tiny.write(tiny.ARCHS["qwen35moe"], tmp_path / "qwen35moe.gguf", matrices="q8_0")
    with pytest.raises(ModelError, match="cuts through the 32-weight quantization groups of .*shared_expert"):
        load_gguf_model(read_gguf(path), quantized=True, group=PlayedRank(0))


def test_sizes_mlx_lm_cannot_split_are_refused_in_one_line(tmp_path):
    path = tiny.write(tiny.ARCHS["qwen3moe"], tmp_path / "qwen3moe.gguf")
    with pytest.raises(ModelError, match="mlx-lm cannot split qwen3_moe across 3 ranks"):
        load_gguf_model(read_gguf(path), quantized=True, group=PlayedRank(0, size=3))


@pytest.mark.parametrize(
    "arch, split", [("llama", "tensor parallel"), ("qwen3_moe", "tensor parallel"), ("qwen3_next", "pipeline parallel")]
)
def test_auto_splits_by_tensor_where_the_architecture_has_it_else_by_pipeline(arch, split):
    from tests.tiny_archs import tiny_model

    assert sharding.shard(tiny_model(arch), PlayedRank(0), "auto").startswith(split)


def test_an_architecture_split_neither_way_is_one_line():
    from tests.tiny_archs import tiny_model

    with pytest.raises(ModelError, match="phi3 can be split across machines neither by tensor nor by pipeline"):
        sharding.shard(tiny_model("phi3"), PlayedRank(0), "auto")
