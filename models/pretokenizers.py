"""How each BPE vocabulary cuts text into words before merging: llama.cpp's pre-tokenizers by `tokenizer.ggml.pre`.

The regexes are llama.cpp's own (src/llama-vocab.cpp, `llm_tokenizer_bpe`), which in turn are the
original models' tokenizer.json patterns. They apply one after another, each cutting every piece the
previous ones left into matches and the text between them, as llama.cpp's `unicode_regex_split` does
and as a `tokenizers` Sequence of isolating Splits does.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_LATIN = (  # letters of the cased scripts, as llama.cpp spells them out
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-"
    "\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113"
    "\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
    "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-"
    "\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_PUNCTUATION = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK3_CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK3_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CASED_WORDS = (  # tekken / gpt-4o: an optional run of capitals, then lower-case letters
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{c}"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{c}"
)
_TEKKEN = _CASED_WORDS.replace("{c}", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = (
    _CASED_WORDS.replace("{c}", _CONTRACTIONS + "?")
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
NEWLINE_RUNS = r"[^\n]+|[\n]+"

# llama.cpp's pre-tokenizer types: their regexes, in the order they apply.
_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "gpt2": (GPT2,),
    "digits-then-gpt2": (r"\p{N}", GPT2),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "qwen35": (_QWEN35,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"),
    "deepseek-llm": ("[\r\n]", _DEEPSEEK_LATIN, _DEEPSEEK_PUNCTUATION, r"\s+$", _DEEPSEEK_CJK, r"\p{N}+"),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}"),
    "deepseek3": (r"\p{N}{1,3}", _DEEPSEEK3_CJK, _DEEPSEEK3_WORDS),
    "tekken": (_TEKKEN,),
    "gpt4o": (_GPT4O,),
    "bloom": (_BLOOM,),
    "viking": (_BLOOM, r"\p{N}"),
    "seed-coder": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "bailingmoe": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "exaone-moe": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "laguna": (NEWLINE_RUNS, _QWEN2),
    "ufakzeka": (_QWEN2[len(_CONTRACTIONS) + 1 :],),
    "minicpm5": (r"\p{N}{1,3}", _QWEN2.replace(r"|\p{N}|", r"|\p{N}+|")),
    "jais2": (
        _LLAMA3.removesuffix(r"|\s+(?!\S)|\s+")
        + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
        + r"|\s{1,2}(?!\S)|\s{1}",
    ),
    "tiny-aya": (r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O),
    "chameleon": (
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        "([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        GPT2,
    ),
    "youtu": (
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        _GPT4O.replace(r"\p{N}{1,3}", r"\p{N}"),
    ),
    "spark2_5": (r"\p{N}{1,3}", _DEEPSEEK3_CJK, _DEEPSEEK3_WORDS.replace(r"[\r\n]*|\s*[\r\n]+", r"|[\r\n]"), r"\p{N}"),
    "newlines": (NEWLINE_RUNS,),
}


@dataclass(frozen=True)
class PreTokenizer:
    """One `tokenizer.ggml.pre` as llama.cpp reads it."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is not merged up from its bytes
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token
    byte_level: bool = True  # GPT-2's byte-to-symbol mapping; False: raw UTF-8 with spaces as "▁"


def _names(kind: str, names: str, **flags: bool) -> dict[str, PreTokenizer]:
    return {name: PreTokenizer(_REGEXES[kind], **flags) for name in names.split()}


# `tokenizer.ggml.pre` values, grouped as llama.cpp's llama_vocab::load groups them.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_names("default", "default"),
    **_names("gpt2", "gpt2 gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert"),
    **_names("gpt2", "mpt olmo jais trillion granite-docling exaone4 jina-v1-en jina-v2-code roberta-bpe"),
    **_names("digits-then-gpt2", "starcoder refact command-r smollm codeshell exaone minerva-7b mellum2"),
    **_names(
        "llama3", "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        ignore_merges=True, add_bos=True,
    ),
    **_names("llama3", "dbrx smaug-bpe chatglm-bpe"),
    **_names("llama3", "glm4 glm5", ignore_merges=True),
    **_names("minicpm5", "minicpm5", ignore_merges=True),
    **_names("ufakzeka", "ufakzeka"),
    **_names("jais2", "jais-2"),
    **_names("tiny-aya", "tiny_aya cohere2moe"),
    **_names("chameleon", "chameleon", add_bos=True),
    **_names("qwen2", "qwen2 deepseek-r1-qwen kormo f2llmv2 stablelm2 megrez hunyuan solar-open grok-2"),
    **_names("qwen35", "qwen35"),
    **_names("falcon", "falcon"),
    **_names("deepseek-llm", "deepseek-llm"),
    **_names("deepseek-coder", "deepseek-coder"),
    **_names("deepseek3", "deepseek-v3 hunyuan-dense joyai-llm hy_v4"),
    **_names("tekken", "tekken", ignore_merges=True, add_bos=True),
    **_names("gpt4o", "gpt-4o llama4 kanana2 talkie minimax-m2"),
    **_names("bloom", "bloom gpt3-finnish poro-chat"),
    **_names("viking", "viking"),
    **_names("seed-coder", "seed-coder"),
    **_names("bailingmoe", "bailingmoe bailingmoe2 llada-moe"),
    **_names("exaone-moe", "exaone-moe"),
    **_names("laguna", "laguna"),
    **_names("youtu", "youtu", ignore_merges=True),
    **_names("spark2_5", "spark2_5"),
    **_names("newlines", "gemma4 granite-embed-multi-311m sarvam-moe", byte_level=False),
}  # fmt: skip


def hf_pre_tokenizer(spec: PreTokenizer) -> pre_tokenizers.PreTokenizer:
    """The same cuts as a `tokenizers` pre-tokenizer, followed by GPT-2's byte mapping when the vocabulary uses it."""
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in spec.regexes]
    if spec.byte_level:
        splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(splits)
