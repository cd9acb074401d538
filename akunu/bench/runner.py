"""The benchmark loop: every method on every prompt, interleaved, with token checks.

For each prompt the methods run back to back in one process, so slow drift of the machine
(heat, other load) hits them alike; the order is mirrored on every other pass (ABCD, DCBA,
...) so that being first after a prompt change is no advantage to any method.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol

from akunu.bench.workloads import Prompt
from akunu.exact import NEAR_TIE_GAP

PLAIN, SPEC, SPEC_FIXED, MLX_LM = "plain", "spec", "spec-fixed", "mlx-lm"
METHODS = (PLAIN, SPEC, SPEC_FIXED, MLX_LM)
LLAMA_CPP = "llama.cpp"  # llama.cpp's plain decoding of the same GGUF, when llama-cpp-python is installed
# Exact mode (akunu.exact): its speculative tokens are compared with its own plain decoding.
PLAIN_EXACT, SPEC_EXACT = "plain-exact", "spec-exact"
REFERENCES = (PLAIN, PLAIN_EXACT)
# Methods whose greedy tokens must equal PLAIN's; MLX_LM and LLAMA_CPP are compared for information only.
MUST_MATCH_PLAIN = (SPEC, SPEC_FIXED)
# "drafter:SPEC" runs speculative decoding (adaptive) with another drafter (akunu.drafters); it must match too.
DRAFTER_PREFIX = "drafter:"


def drafter_method(spec: str) -> str:
    return DRAFTER_PREFIX + spec


@dataclass
class Run:
    """One generation by one method, timed the same way for every method."""

    tokens: list[int]
    prompt_tokens: int
    prefill_seconds: float  # from the call to the first token
    decode_seconds: float  # from the first token to the last
    forward_passes: int = 0  # decode passes (0 where the method does not count them)
    drafted: int = 0
    accepted: int = 0
    accepted_lengths: dict[int, int] = field(default_factory=dict)  # accepted drafts per verification
    drafting_seconds: float = 0.0  # host time spent in the drafter
    collectives: int = 0  # under mlx.launch: the round trips between the ranks after the first token
    bytes_sent: int = 0  # and what this rank gave them

    @property
    def generated(self) -> int:
        return len(self.tokens)

    @property
    def decode_tps(self) -> float:
        """Tokens after the first (which prefill produced) per second of decoding."""
        return (self.generated - 1) / self.decode_seconds if self.decode_seconds > 0 and self.generated > 1 else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0


@dataclass
class Measurement:
    prompt_id: str
    category: str
    method: str
    repeat: int
    position: int  # the method's place in this prompt's order, from 0
    run: Run

    def to_dict(self) -> dict:
        record = asdict(self)
        record["run"]["accepted_lengths"] = {str(k): v for k, v in sorted(self.run.accepted_lengths.items())}
        record["run"].update(
            generated=self.run.generated,
            decode_tps=round(self.run.decode_tps, 3),
            prefill_tps=round(self.run.prefill_tps, 3),
        )
        return record


@dataclass(frozen=True)
class Mismatch:
    """Two methods disagreed on the tokens of one greedy generation."""

    prompt_id: str
    category: str
    repeat: int
    method: str
    reference: str
    index: int  # the first token that differs
    expected: int | None  # the reference's token there (None: the reference ended)
    got: int | None
    informational: bool  # True for comparisons that may legitimately differ (mlx-lm, llama.cpp)
    top2_gap: float | None = None  # the reference's top-two logit gap at `index` (None: not measured)

    @property
    def near_tie(self) -> bool:
        """Allowed by the default mode's guarantee: a k-token pass rounded a (near-)tie the other way."""
        return self.reference == PLAIN and self.top2_gap is not None and self.top2_gap <= NEAR_TIE_GAP


@dataclass
class BenchResult:
    measurements: list[Measurement] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    checked: bool = False  # whether tokens were compared (greedy runs only)
    prompt_ids: dict[str, list[int]] = field(default_factory=dict)  # each prompt as the model saw it

    @property
    def counted_mismatches(self) -> list[Mismatch]:
        return [m for m in self.mismatches if not m.informational]

    @property
    def failing_mismatches(self) -> list[Mismatch]:
        """Mismatches the guarantee does not allow: any in exact mode; in the default mode, any not at a near-tie."""
        return [m for m in self.counted_mismatches if not m.near_tie]


class Engine(Protocol):
    """What the runner needs from a model: prompt ids, and one timed generation per method.

    An engine may also offer `top2_gap(reference_method, prompt_ids, tokens, index)`, measured on mismatches.
    """

    def encode(self, prompt: Prompt) -> list[int]: ...

    def run(self, method: str, prompt_ids: list[int]) -> Run: ...


def reference_of(method: str) -> str:
    return PLAIN_EXACT if method == SPEC_EXACT else PLAIN


def method_order(pass_index: int, methods: Sequence[str]) -> list[str]:
    """The methods in the order of pass `pass_index`: as given on even passes, mirrored on odd ones."""
    return list(methods) if pass_index % 2 == 0 else list(reversed(methods))


def first_difference(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """The first index where the two differ (a length difference counts); None if they are equal."""
    from akunu.kv_cache import common_prefix  # here: the bench library loads MLX only when it runs a model

    shared = common_prefix(reference, other)
    return None if shared == len(reference) == len(other) else shared


def compare_tokens(prompt: Prompt, repeat: int, runs: dict[str, Run]) -> list[Mismatch]:
    """Mismatches of this pass against the plain tokens of the same mode: counted for speculation, informational for baselines."""
    found = []
    for method, run in runs.items():
        reference = reference_of(method)
        if method in REFERENCES or reference not in runs:
            continue
        expected_tokens = runs[reference].tokens
        index = first_difference(expected_tokens, run.tokens)
        if index is not None:
            expected = expected_tokens[index] if index < len(expected_tokens) else None
            got = run.tokens[index] if index < len(run.tokens) else None
            informational = method not in (*MUST_MATCH_PLAIN, SPEC_EXACT) and not method.startswith(DRAFTER_PREFIX)
            found.append(
                Mismatch(prompt.id, prompt.category, repeat, method, reference, index, expected, got, informational)
            )
    return found


def _with_gap(engine: Engine, mismatch: Mismatch, prompt_ids: list[int], runs: dict[str, Run]) -> Mismatch:
    """The mismatch with the reference's top-two logit gap where the tokens part, if the engine can measure it."""
    measure = getattr(engine, "top2_gap", None)
    tokens = runs[mismatch.reference].tokens
    if measure is None or mismatch.informational or mismatch.index >= len(tokens):
        return mismatch
    return replace(mismatch, top2_gap=measure(mismatch.reference, prompt_ids, tokens, mismatch.index))


def run_benchmark(
    prompts: Sequence[Prompt],
    engine: Engine,
    *,
    methods: Sequence[str] = METHODS,
    repeats: int = 1,
    check_tokens: bool = True,
    warmup: bool = True,
    on_measurement: Callable[[Measurement], None] | None = None,
    on_mismatch: Callable[[Mismatch], None] | None = None,
    on_warmup: Callable[[str], None] | None = None,
) -> BenchResult:
    """Run `methods` on every prompt `repeats` times, interleaved, after one unrecorded warm-up per method.

    `check_tokens` (for greedy runs) compares every method's tokens with plain decoding's (exact mode's
    with exact plain decoding's) and, where they differ, asks the engine for the top-two logit gap there.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1 (got {repeats})")
    result = BenchResult(checked=check_tokens)
    encoded = [(prompt, engine.encode(prompt)) for prompt in prompts]
    result.prompt_ids = {prompt.id: ids for prompt, ids in encoded}
    if warmup and encoded:
        for method in methods:  # first calls pay for allocation and kernel setup
            if on_warmup:
                on_warmup(method)
            engine.run(method, encoded[0][1])
    pass_index = 0
    for prompt, ids in encoded:
        for repeat in range(repeats):
            runs: dict[str, Run] = {}
            for position, method in enumerate(method_order(pass_index, methods)):
                runs[method] = engine.run(method, ids)
                measurement = Measurement(prompt.id, prompt.category, method, repeat, position, runs[method])
                result.measurements.append(measurement)
                if on_measurement:
                    on_measurement(measurement)
            pass_index += 1
            if check_tokens:
                for mismatch in compare_tokens(prompt, repeat, runs):
                    mismatch = _with_gap(engine, mismatch, ids, runs)
                    result.mismatches.append(mismatch)
                    if on_mismatch:
                        on_mismatch(mismatch)
    return result
