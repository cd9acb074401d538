"""Constrained decoding: a grammar (a JSON schema, any JSON object, or a Lark grammar) the output must follow.

A `Constraint` wraps an llguidance matcher whose state follows the committed tokens. The
decode loops ask it three things: the allowed tokens at each verified position (`masks`: the
logits are masked before the greedy or speculative accept test, so sampling stays exact for the
constrained distribution), a draft cut to what the grammar allows with the tokens it forces
added for free (`grammar_draft`: jump-forward riding in the same verification pass), and to
commit what was accepted. Drafted tokens are consumed only to compute their masks and rolled
back at once, so the matcher never holds a rejected token.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from akunu.drafters.base import Draft
from akunu.errors import OptionsError

log = logging.getLogger("akunu.grammar")
MESSAGE_CHARS = 200  # llguidance's errors may carry the whole grammar; the caller gets the start of one line


class GrammarError(OptionsError):
    """A grammar that cannot be followed: malformed, admitting no output, or too complex for the parser."""


def _over_limits(error: str) -> bool:
    """Whether llguidance gave up at one of its parser limits (LLParserLimits)."""
    return any(word in error for word in ("max is", "fuel", "TooComplex", "too complex"))


def _parser_failure(error: str, otherwise: str) -> GrammarError:
    """The error for a matcher that gave up: at its limits, the schema is too complex; else `otherwise`."""
    reason = "the schema is too complex for constrained decoding" if _over_limits(error) else otherwise
    return GrammarError(f"{reason}: {_short(error)}")


def _short(error: str) -> str:
    """The first line of an llguidance error, cut to MESSAGE_CHARS; the whole of it goes to the debug log."""
    log.debug("llguidance: %s", error)
    line = error.strip().splitlines()[0] if error.strip() else "unknown error"
    return line if len(line) <= MESSAGE_CHARS else line[: MESSAGE_CHARS - 1] + "…"


class _VocabularyView:
    """What llguidance's TokenizerWrapper reads from a tokenizer: every token's bytes, BOS/EOS, an encoder."""

    def __init__(self, tokenizer) -> None:
        self.tokens = list(tokenizer.token_bytes)
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eos_ids, default=None)
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text, add_bos=False, parse_special=False)


@functools.lru_cache(maxsize=4)
def _guidance_tokenizer(tokenizer):
    """llguidance's view of `tokenizer` (about a second to build for a large vocabulary, so kept)."""
    import llguidance

    eos = sorted(tokenizer.eos_ids) or None  # any end-of-turn token may end a finished output
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_VocabularyView(tokenizer)), eos_token=eos)


# JSON as json.dumps writes it, the way models write it; no free whitespace, which a model could run on in.
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def json_schema_grammar(schema: dict, *, lenient: bool = False) -> str:
    """The llguidance grammar of JSON documents valid for `schema`; `lenient` ignores keywords it does not implement."""
    import llguidance

    if not isinstance(schema, dict):
        raise OptionsError("a JSON schema must be a JSON object")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={**JSON_LAYOUT, "lenient": lenient})
    except ValueError as error:
        raise GrammarError(f"the JSON schema cannot be used: {_short(str(error))}") from None
    if lenient:
        refuse_unenforced_keywords(schema)
    return grammar


def refuse_unenforced_keywords(schema: dict) -> None:
    """A GrammarError, as strict mode gives, for keywords that constrain a value but llguidance cannot enforce
    (`not`, `if`, `uniqueItems`, ...): output that ignored them would break the schema. Lenient mode still ignores
    the rest (unknown keys, unknown formats: annotations)."""
    import llguidance

    strict = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={**JSON_LAYOUT, "lenient": False})
    error = llguidance.LLMatcher.validate_grammar(strict)
    if error.startswith("Unimplemented keys"):
        raise GrammarError(f"the grammar cannot be used: {_short(error)}")


def response_format_grammar(response_format) -> str | None:
    """The grammar an OpenAI `response_format` asks for (None for plain text); a bad one is an OptionsError.

    `json_schema` with `strict: false` ignores unknown keys and formats, with `strict: true` they are an error;
    either way a keyword that constrains a value but cannot be enforced (`not`, `if`, ...) is an error, so the
    output is JSON valid for the whole schema."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind != "json_schema":
        raise OptionsError("response_format.type must be text, json_object or json_schema")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise OptionsError("response_format.json_schema must be an object with a 'schema' object")
    return json_schema_grammar(spec.get("schema", {}), lenient=spec.get("strict") is not True)


def wrapped_json_grammar(prefix: str, schema: dict, suffix: str, *, separator: str | None = None) -> str:
    """A Lark grammar of `prefix` + JSON valid for `schema` + `suffix` (a forced tool call, e.g. Hermes'
    "<tool_call>\\n" ... "\\n</tool_call>"); with a `separator`, one or more of them separated by it.
    Unknown keys and formats are ignored, as tool parameters often carry some; keywords that constrain a value but
    llguidance cannot enforce are refused (`refuse_unenforced_keywords`)."""
    if not isinstance(schema, dict):
        raise OptionsError("a JSON schema must be a JSON object")
    refuse_unenforced_keywords(schema)
    body = json.dumps({**schema, "x-guidance": {**JSON_LAYOUT, "lenient": True}})
    start = "item" if separator is None else f"item ({json.dumps(separator)} item)*"
    return lark_grammar(f"start: {start}\nitem: {json.dumps(prefix)} body {json.dumps(suffix)}\nbody: %json {body}\n")


def lark_grammar(text: str) -> str:
    """The llguidance grammar of a Lark grammar (`%json {...}` embeds a JSON schema)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(text)


class Constraint:
    """The grammar state of one generation; build with `json_schema`, `json_object` or `lark`."""

    def __init__(self, grammar: str, tokenizer, *, jump_forward: bool = True) -> None:
        import llguidance

        self.jump_forward = jump_forward  # draft the tokens the grammar forces (off: only check the drafter's)
        if not tokenizer.eos_ids:  # a finished output could never end
            raise OptionsError("constrained output needs a model with an end-of-text token")
        limits = llguidance.LLParserLimits(verbose_errors=False)  # errors without a dump of the grammar
        self.matcher = llguidance.LLMatcher(_guidance_tokenizer(tokenizer), grammar, log_level=0, limits=limits)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {_short(self.matcher.get_error())}")
        self.vocab_size = tokenizer.vocab_size
        self.eos_ids = frozenset(tokenizer.eos_ids)
        self._words = np.zeros((1, (self.vocab_size + 31) // 32), dtype=np.int32)

    @classmethod
    def json_schema(cls, schema: dict, tokenizer, **options) -> Constraint:
        return cls(json_schema_grammar(schema), tokenizer, **options)

    @classmethod
    def json_object(cls, tokenizer, **options) -> Constraint:
        return cls(json_schema_grammar({"type": "object"}), tokenizer, **options)

    @classmethod
    def lark(cls, text: str, tokenizer, **options) -> Constraint:
        return cls(lark_grammar(text), tokenizer, **options)

    def check_start(self) -> None:
        """A GrammarError now, before any generation, for a grammar that admits no output or whose parser gives
        up at its first token (too complex): the first mask is computed and one allowed token tried."""
        empty = "the grammar admits no output (no JSON value satisfies the schema)"
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self.matcher.is_error():
            raise _parser_failure(self.matcher.get_error(), empty)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self.vocab_size]
        tokens = [int(t) for t in np.flatnonzero(bits) if t not in self.eos_ids]
        if self.matcher.is_stopped() or not tokens:
            raise GrammarError(empty)
        self.commit(tokens[:1])
        self.matcher.rollback(1)

    def reset(self) -> None:
        self.matcher.reset()

    @property
    def finished(self) -> bool:
        """The output is complete: only an end-of-turn token may follow."""
        return self.matcher.is_stopped()

    def commit(self, tokens: Sequence[int]) -> None:
        """Tokens accepted into the output; each was allowed by the mask it was chosen under.
        An end token is allowed only where the output may end, and ends it, so the matcher skips it."""
        tokens = [t for t in tokens if t not in self.eos_ids]
        if tokens and not self.matcher.consume_tokens(tokens):
            error = self.matcher.get_error()
            if _over_limits(error):  # the mask allowed the token; the parser gave up on it
                raise _parser_failure(error, "")
            raise RuntimeError(f"a token the grammar forbids was committed: {_short(error)}")

    def constrain(self, logits: mx.array, draft: Sequence[int] = ()) -> mx.array:
        """`logits` ((V,) or (len(draft) + 1, V)) with the tokens the grammar forbids at -inf."""
        allowed = self.masks(draft, logits.shape[-1])
        return apply_mask(logits, allowed if logits.ndim == 2 else allowed[0])

    def masks(self, draft: Sequence[int], width: int) -> mx.array:
        """Allowed tokens (bool, (len(draft) + 1, width)) after the committed output and after each draft prefix."""
        rows = [self._mask_words()]
        for token in draft:
            self.commit([token])
            rows.append(self._mask_words())
        self.matcher.rollback(len(draft))
        bits = np.unpackbits(np.concatenate(rows).view(np.uint8), axis=-1, bitorder="little")[:, : self.vocab_size]
        if width > self.vocab_size:  # rows past the tokenizer's vocabulary (padding) are never allowed
            bits = np.pad(bits, ((0, 0), (0, width - self.vocab_size)))
        return mx.array(bits[:, :width].astype(bool))

    def _mask_words(self) -> np.ndarray:
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self.matcher.is_error():  # the parser gave up: the schema, not the engine, is at fault
            raise _parser_failure(self.matcher.get_error(), "the grammar cannot be followed")
        return self._words.copy()

    def extend(self, proposal: Sequence[int], limit: int) -> tuple[list[int], list[bool]]:
        """The tokens to verify: the proposal cut at the first token the grammar forbids, with the tokens
        the grammar forces put in for free (where it forces other tokens, the proposal ends there).

        Returns the tokens and, for each, whether the grammar forced it."""
        tokens, forced_at, aligned = [], [], True
        while len(tokens) < limit:
            forced = self.matcher.compute_ff_tokens()[: limit - len(tokens)] if self.jump_forward else []
            here = proposal[len(tokens) : len(tokens) + len(forced)]
            if forced:
                aligned = aligned and list(here) == forced
                taken = forced
            elif aligned and len(tokens) < len(proposal) and self._allows(proposal[len(tokens)]):
                taken = [proposal[len(tokens)]]
            else:
                break
            self.commit(taken)
            tokens += taken
            forced_at += [bool(forced)] * len(taken)
        self.matcher.rollback(len(tokens))
        return tokens, forced_at

    def _allows(self, token: int) -> bool:
        return token not in self.eos_ids and self.matcher.validate_tokens([token]) == 1  # a draft never ends the output


def grammar_draft(constraint: Constraint, proposal: Draft, limit: int) -> tuple[Draft, int]:
    """`proposal` checked against the grammar and extended by the tokens it forces (see `Constraint.extend`).

    Returns the draft and how many of its leading tokens are the proposal's own (for the length policy).
    A forced token is drafted whatever the drafter sampled, so its proposal distribution is one-hot."""
    tokens, forced = constraint.extend(proposal.tokens, limit)
    own = next((i for i, t in enumerate(tokens) if i >= len(proposal) or proposal.tokens[i] != t), len(tokens))
    probs = None
    if proposal.probs is not None and tokens:
        width = proposal.probs.shape[-1]
        one_hot = [(mx.arange(width) == t).astype(proposal.probs.dtype) for t in tokens]
        probs = mx.stack([one_hot[i] if f else proposal.probs[i] for i, f in enumerate(forced)])
    return Draft(tokens, probs, match=proposal.match), own


def apply_mask(logits: mx.array, allowed: mx.array) -> mx.array:
    """Logits with every forbidden token at -inf."""
    return mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))


def parse_schema_file(text: str, source: str) -> dict:
    """A JSON schema from a file's text; a bad file is one clear line."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise OptionsError(f"{source} is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise OptionsError(f"{source} must hold a JSON object (a JSON schema)")
    return schema
