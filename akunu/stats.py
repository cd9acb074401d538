"""Per-generation statistics, updated in place as tokens stream."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # fewer than prompt_tokens when a prompt cache was reused
    generated_tokens: int = 0
    forward_passes: int = 0  # decode passes: single steps and verifications
    drafted: int = 0
    accepted: int = 0
    accepted_lengths: Counter = field(default_factory=Counter)  # accepted drafts per verification
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    drafting_seconds: float = 0.0  # host time the drafter spent proposing and learning tokens
    peak_memory_mb: float = 0.0
    finish_reason: str | None = None
    ended_on_eos: bool = False  # the model's end token was produced (and not counted as generated)
    stop_string: str | None = None  # the stop string that ended the answer, if one did

    def snapshot(self) -> GenerationStats:
        """A copy that later rounds leave alone (each streamed response carries its own)."""
        return replace(self, accepted_lengths=Counter(self.accepted_lengths))

    def record_round(self, drafted: int, accepted: int) -> None:
        self.forward_passes += 1
        self.drafted += drafted
        self.accepted += accepted
        if drafted:
            self.accepted_lengths[accepted] += 1

    @contextmanager
    def drafting(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.drafting_seconds += time.perf_counter() - start

    @property
    def drafting_share(self) -> float:
        """Drafting time as a share of decode time: what the drafter costs beside the forward passes."""
        return self.drafting_seconds / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens each decode pass produced, the end token included; the first comes from prefill."""
        decoded = max(self.generated_tokens + self.ended_on_eos - 1, 0)
        return decoded / self.forward_passes if self.forward_passes else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        decoded = max(self.generated_tokens - 1, 0)
        return decoded / self.decode_seconds if self.decode_seconds else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_tps": round(self.prefill_tps, 2),
            "decode_tps": round(self.decode_tps, 2),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "drafting_seconds": round(self.drafting_seconds, 6),
            "peak_memory_mb": round(self.peak_memory_mb, 1),
            "forward_passes": self.forward_passes,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_pass": round(self.tokens_per_pass, 4),
            "accepted_lengths": {str(k): v for k, v in sorted(self.accepted_lengths.items())},
            "finish_reason": self.finish_reason,
        }
