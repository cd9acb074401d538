"""`load_model(spec)`: a catalogue name, a .gguf path, an MLX model folder or a Hugging Face repo id."""

from __future__ import annotations

import ctypes
import re
import sys
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from akunu import backends, distributed
from akunu.errors import ModelError
from akunu.files import special_kind
from akunu.models import catalogue
from akunu.models.dtype_policy import DtypeChoice, choose_dtype
from akunu.models.fetch import Progress
from akunu.models.gguf_file import read_gguf

if TYPE_CHECKING:
    from akunu.models.tokenizer import Tokenizer

HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What `_load_mlx_folder` reads: config.json, tokenizer.json and other configs, the weights, a chat template.
MLX_FOLDER_FILES = ["*.json", "model*.safetensors", "chat_template.jinja"]
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
VOCABULARY_KEYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)


@dataclass
class LoadedModel:
    model: nn.Module  # an mlx-lm Model: model(tokens[None], cache=...) -> logits
    tokenizer: Tokenizer
    name: str  # catalogue name, or the path / repo id given
    path: Path
    architecture: str  # "llama", "gemma3", ...
    dtype: str  # "quantized" or "float32" ("float16"/"bfloat16" for MLX folders kept as they are)
    context_length: int
    dtype_reason: str = ""
    load_seconds: float = 0.0
    sharded: str = ""  # how the model is split across the ranks of an `mlx.launch` run ("" when whole)

    @property
    def parameter_count(self) -> int:
        from mlx_lm.utils import get_total_parameters

        return int(get_total_parameters(self.model))

    def describe(self) -> str:
        return f"{self.name}: {self.architecture}, {_human_count(self.parameter_count)} params, {self.dtype} weights"


def load_model(spec: str, *, dtype: str = "auto", progress: Progress | None = None, shard: str = "auto") -> LoadedModel:
    """Load a model and its tokenizer; every failure a user can cause is a one-line ModelError.

    Under `mlx.launch`, this rank's part of it (`shard`: "auto", "tensor" or "pipeline", see `sharding`), before the
    CPU backend sees it: the backend's kernels then run the projections the rank keeps as plain layers."""
    choose_dtype(dtype)  # reject a bad --dtype before any download
    _map_large_allocations()
    started = time.perf_counter()
    cache_limit = mx.set_cache_limit(0)  # arrays replaced while loading are freed, not cached on top of the rest
    try:
        path = locate(spec, progress)
        group = distributed.group()
        if path.is_file():
            loaded = _load_gguf(path, spec, dtype, progress, group, shard)
        else:
            loaded = _load_mlx_folder(path, spec, dtype, group, shard)
        backends.apply(loaded.model)  # the CPU backend's faster step where it applies; elsewhere mlx-lm's model
        if group is not None:  # each pass counts its collectives, and may stop where rank 0 asks
            distributed.count_passes(loaded.model)
    finally:
        mx.set_cache_limit(cache_limit)
    return_freed_memory()
    loaded.load_seconds = time.perf_counter() - started
    return loaded


def _map_large_allocations() -> None:
    """Have glibc map buffers of 128 KiB or more on their own (its default, which it otherwise raises as large
    buffers are freed), so a freed one goes back to the system at once: a load makes and frees many arrays,
    and in the heap their holes would stay resident."""
    _glibc_call("mallopt", M_MMAP_THRESHOLD, 128 << 10)


def return_freed_memory() -> None:
    """Hand the load's freed scratch back to the system: glibc keeps freed heap pages (resident) otherwise."""
    mx.clear_cache()
    _glibc_call("malloc_trim", 0)


def _glibc_call(name: str, *args: int) -> None:
    if sys.platform == "linux":
        try:
            getattr(ctypes.CDLL("libc.so.6"), name)(*args)
        except (OSError, AttributeError):  # not glibc
            pass


def load_tokenizer(spec: str, *, progress: Progress | None = None) -> Tokenizer:
    """The tokenizer of the model `spec` names, without its weights: enough to compare two models' vocabularies."""
    from akunu.models.tokenizer import Tokenizer

    path = locate(spec, progress)
    return Tokenizer.from_gguf(path) if path.is_file() else Tokenizer.from_hf_dir(path)


def locate(spec: str, progress: Progress | None = None) -> Path:
    """The GGUF file or MLX model folder `spec` names; a catalogue model or hub repo is fetched first."""
    if spec in catalogue.KNOWN:
        return catalogue.resolve(spec, progress=progress)
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if (what := special_kind(path)) not in (None, "a folder"):  # a FIFO would block the read; a device is no model
        raise ModelError(f"{spec} is {what}, not a GGUF file or an MLX model folder")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{spec} is a folder without config.json (expected an MLX model folder)")
        return path
    if _looks_like_path(spec):
        raise ModelError(f"no such model file: {spec}")
    if HF_REPO_ID.match(spec):
        return _download_from_hub(spec)
    raise catalogue.unknown_model(spec)


def _looks_like_path(spec: str) -> bool:
    return spec.endswith(".gguf") or spec.startswith((".", "/", "~")) or spec.count("/") > 1


def _load_gguf(path: Path, name: str, dtype: str, progress: Progress | None, group: Any, shard: str) -> LoadedModel:
    from akunu.models.gguf_model import load_gguf_model
    from akunu.models.gguf_weights import decode_products
    from akunu.models.tokenizer import Tokenizer

    gguf_file = read_gguf(path)
    choice = _agreed(
        lambda: choose_dtype(
            dtype,
            float32_bytes=4 * sum(_element_count(t.shape) for t in gguf_file.tensors.values()),
            products=decode_products(gguf_file) if dtype == "auto" else None,
        )
    )
    # The tokenizer first: its build's scratch is freed before the weights arrive, not on top of them.
    tokenizer = Tokenizer.from_gguf_metadata(gguf_file.metadata, source=str(path))
    for key in VOCABULARY_KEYS:  # the tokenizer has what it needs of them
        gguf_file.metadata.pop(key, None)
    return_freed_memory()
    model, config = load_gguf_model(
        gguf_file, quantized=choice.dtype == "quantized", progress=progress, group=group, shard=shard
    )
    if tokenizer.vocab_size > config["vocab_size"]:  # ids past the embedding would read out of bounds
        raise ModelError(
            f"{Path(path).name}: the vocabulary has {tokenizer.vocab_size} tokens, but "
            f"token_embd.weight has only {config['vocab_size']} rows"
        )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        path=Path(path),
        architecture=gguf_file.architecture,
        dtype=choice.dtype,
        context_length=int(config["max_position_embeddings"]),
        dtype_reason=choice.reason,
        sharded=config.get("sharded", ""),
    )


def _agreed(choose: Callable[[], DtypeChoice]) -> DtypeChoice:
    """The dtype rank 0 chooses (its timing decides for every rank), or this process's own when alone."""
    if distributed.group() is None:
        return choose()
    return DtypeChoice(*distributed.agree(list(astuple(choose())) if distributed.leads() else None))


def _load_mlx_folder(path: Path, name: str, dtype: str, group: Any = None, shard: str = "auto") -> LoadedModel:
    """An mlx-community style folder (config.json + safetensors), loaded by mlx-lm itself; with a distributed
    `group`, loaded lazily and split first, so a rank reads only the slices it keeps."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    from akunu.models import sharding
    from akunu.models.tokenizer import Tokenizer

    try:
        model, config = mlx_lm_load_model(path, lazy=group is not None)
        context_length = int(_context_length(config))
    except Exception as error:  # noqa: BLE001 - a model folder is untrusted input: whatever breaks, one line
        raise ModelError(f"cannot load the MLX model in {path}: {_folder_failure(error)}") from None
    sharded = ""
    if group is not None:
        sharded = sharding.shard(model, group, shard)
        for layer in model.layers:  # one layer's slices at a time: whole tensors are read and freed as they go
            mx.eval(layer.parameters() if layer is not None else [])
        mx.eval(model.parameters())
        requested = dtype  # rank 0's resolution of "auto" (memory differs between machines), applied everywhere
        dtype = _agreed(lambda: choose_dtype(requested, float32_bytes=4 * int(_parameter_count(model)))).dtype
    choice = _folder_dtype(model, config, dtype)
    return LoadedModel(
        model=model,
        tokenizer=Tokenizer.from_hf_dir(path),
        name=name,
        path=path,
        architecture=str(config.get("model_type", "unknown")),
        dtype=choice.dtype,
        context_length=context_length,
        dtype_reason=choice.reason,
        sharded=sharded,
    )


def _parameter_count(model: nn.Module) -> int:
    from mlx_lm.utils import get_total_parameters

    return get_total_parameters(model)


def _folder_failure(error: Exception) -> str:
    """What mlx-lm's failure says about the folder, in one line."""
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, TypeError) and "argument" in reason:  # ModelArgs(**config) without required fields
        return f"config.json lacks what the architecture needs ({reason})"
    if isinstance(error, RuntimeError) and "safetensors" in reason:
        return f"a weights file is not valid safetensors ({reason})"
    return reason


def _folder_dtype(model: nn.Module, config: dict[str, Any], requested: str) -> DtypeChoice:
    """Apply the dtype policy to an mlx-lm model; "quantized" keeps a float folder as it is."""
    from mlx_lm.utils import dequantize_model, get_total_parameters

    quantized = "quantization" in config
    choice = choose_dtype(requested, float32_bytes=4 * int(get_total_parameters(model)))
    if choice.dtype == "float32":
        dequantize_model(model)
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
        return choice
    if quantized:
        return choice
    return DtypeChoice(_float_dtype_name(model), "unquantized MLX weights kept as they are")


def _float_dtype_name(model: nn.Module) -> str:
    from mlx.utils import tree_flatten

    for _, array in tree_flatten(model.parameters()):
        if mx.issubdtype(array.dtype, mx.floating):
            return str(array.dtype).removeprefix("mlx.core.")
    return "float32"


def _context_length(config: dict[str, Any]) -> int:
    text_config = config.get("text_config") or {}
    for source in (config, text_config):
        for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
            if isinstance(source.get(key), int):
                return source[key]
    return 4096


def _download_from_hub(repo_id: str) -> Path:
    """Fetch the files of an MLX model repo that `_load_mlx_folder` reads."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=MLX_FOLDER_FILES))
    except Exception as error:  # noqa: BLE001  (hub errors come in many classes)
        raise ModelError(_hub_failure(repo_id, error)) from None


def _hub_failure(repo_id: str, error: Exception) -> str:
    from huggingface_hub import errors as hub_errors

    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if isinstance(error, hub_errors.GatedRepoError):
        return f"{repo_id} is gated on the Hugging Face hub: accept its license and log in with `hf auth login`"
    if isinstance(error, hub_errors.RepositoryNotFoundError):
        return f"no model '{repo_id}' on the Hugging Face hub (and no catalogue name or local path by that name)"
    offline = (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, ConnectionError, TimeoutError)
    if isinstance(error, offline) or any(sign in type(error).__name__ for sign in ("Connect", "Timeout", "Network")):
        return f"no network to fetch {repo_id} from the Hugging Face hub"
    return f"cannot fetch {repo_id} from the Hugging Face hub: {first_line[:200]}"


def _element_count(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _human_count(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.0f}{unit}" if count >= 10 * scale else f"{count / scale:.1f}{unit}"
    return str(count)
