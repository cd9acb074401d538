"""Which tokens end generation, as llama.cpp decides it (llama_vocab::load, `special_eog_ids`).

A model declares one EOS, but chat models end a turn with another token (`<|im_end|>`, `<|eot_id|>`,
`<end_of_turn>`, `<|end|>`, harmony's `<|return|>`/`<|call|>`), and code models stop at their
fill-in-the-middle separators. Files seldom declare all of them, so they are known by their text too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Texts of tokens that end generation wherever they appear in a vocabulary: llama.cpp's list, less "</s>",
# which is the declared EOS where it ends a turn (Llama 2, Mistral) and an ordinary token, HTML's
# strike-through tag, in Qwen's and Gemma's vocabularies.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<｜end▁of▁sentence｜>", "[e~[",
    }
)  # fmt: skip

# Fill-in-the-middle pad, repository and file separators (the first token of each group found): a code
# model's document ends at them.
_FIM_STOP_GROUPS = (
    ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ("<|file_sep|>",),
)
_DECLARED_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
)


def gguf_end_of_generation_ids(metadata: Mapping[str, Any], tokens: Sequence[str]) -> frozenset[int]:
    """End-of-generation ids of a GGUF vocabulary: declared ids, FIM separators and end-of-turn texts."""
    declared = {i for key in _DECLARED_KEYS if (i := _token_id(metadata, key, len(tokens))) is not None}
    return end_of_generation_ids(tokens, declared)


def end_of_generation_ids(
    tokens: Sequence[str], declared: Iterable[int], *, among: Iterable[int] | None = None
) -> frozenset[int]:
    """`declared` plus the tokens (of `among`, default all) with an end-of-turn or FIM separator text, except
    harmony's `<|end|>`, which only closes a message: its turn ends at `<|return|>` or `<|call|>`."""
    ids = {i for i in declared if 0 <= i < len(tokens)}
    candidates = sorted(range(len(tokens)) if among is None else among)
    ids |= {i for i in candidates if tokens[i] in END_OF_GENERATION_TEXTS}
    for group in _FIM_STOP_GROUPS:
        found = next((i for i in candidates if tokens[i] in group), None)
        if found is not None:
            ids.add(found)
    by_text = {tokens[i]: i for i in ids}
    if "<|end|>" in by_text and (
        {"<|return|>", "<|call|>"} <= by_text.keys() or {"<|calls|>", "<|flush|>"} <= by_text.keys()
    ):
        ids.discard(by_text["<|end|>"])
    return frozenset(ids)


def _token_id(metadata: Mapping[str, Any], key: str, vocab_size: int) -> int | None:
    value = metadata.get(key)
    if value is None or not 0 <= int(value) < vocab_size:
        return None
    return int(value)
