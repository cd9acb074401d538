"""How generation statistics read on screen: the live status line, the summary, the /stats table, JSON."""

from __future__ import annotations

from rich.cells import cell_len
from rich.table import Table
from rich.text import Text

DRAFT_STYLE = "black on green"  # accepted draft tokens under --verbose


def status_line(stats) -> Text:
    """The live line under a streaming answer."""
    parts = [f"{stats.generated_tokens} tok", f"{stats.decode_tps:.1f} tok/s"]
    if stats.drafted:
        parts += [
            f"accept {stats.acceptance_rate:.0%}",
            f"{stats.tokens_per_pass:.2f} tok/pass",
            f"drafted {stats.drafted} accepted {stats.accepted}",
        ]
    parts.append(f"{stats.peak_memory_mb:.0f} MB")
    return Text("● " + " · ".join(parts), style="dim")


# The summary's fields shortened, then dropped, in this order until the line fits: least useful first.
SUMMARY_CUTS = ("prefill", "prefill", "memory", "drafts", "passes", "drafts")


def summary_line(stats, finish_reason: str | None, width: int | None = None) -> str:
    """One line after an answer; `prefill N tok (M cached` shows how much of the prompt was reused.

    Within `width` columns the least useful fields are shortened or left out first, so the line never wraps
    inside a field; the tokens, the speed and how the answer ended always stay.
    """
    fields = _summary_fields(stats, finish_reason)
    chosen = dict.fromkeys(fields, 0)

    def render() -> str:
        return " · ".join(fields[name][at] for name, at in chosen.items() if fields[name][at] is not None)

    for name in SUMMARY_CUTS:
        if width is None or cell_len(render()) <= width:
            break
        if name in chosen:
            chosen[name] += 1
    return render()


def _summary_fields(stats, finish_reason: str | None) -> dict[str, list[str | None]]:
    """Each field's forms, longest first; None leaves it out."""
    cached = stats.prompt_tokens - stats.prefilled_tokens
    fields: dict[str, list[str | None]] = {
        "tokens": [f"{stats.generated_tokens} tok"],
        "speed": [f"{stats.decode_tps:.1f} tok/s"],
        "prefill": [
            f"prefill {stats.prefilled_tokens} tok ({cached} cached, {stats.prefill_tps:.0f} tok/s)",
            f"prefill {stats.prefilled_tokens} tok",
            None,
        ],
    }
    if stats.drafted:
        fields["passes"] = [f"{stats.tokens_per_pass:.2f} tok/pass", None]
        fields["drafts"] = [
            f"accepted {stats.accepted}/{stats.drafted} drafts ({stats.acceptance_rate:.0%})",
            f"accepted {stats.acceptance_rate:.0%}",
            None,
        ]
    fields["memory"] = [f"{stats.peak_memory_mb:.0f} MB", None]
    fields["finish"] = [finish_reason or "?"]
    return fields


def stats_table(stats, title: str, finish_reason: str | None = None) -> Table:
    """Every number of one generation, for /stats and `generate --verbose`."""
    table = Table(title=title, show_header=False, box=None, title_justify="left", title_style="bold")
    table.add_column(style="cyan")
    table.add_column(justify="right")
    rows = [
        ("prompt tokens", f"{stats.prompt_tokens}"),
        ("prefilled tokens", f"{stats.prefilled_tokens}"),
        ("prefill", f"{stats.prefill_tps:.1f} tok/s in {stats.prefill_seconds:.3f} s"),
        ("generated tokens", f"{stats.generated_tokens}"),
        ("decode", f"{stats.decode_tps:.1f} tok/s in {stats.decode_seconds:.3f} s"),
        ("forward passes", f"{stats.forward_passes}"),
        ("tokens per pass", f"{stats.tokens_per_pass:.2f}"),
        ("drafted / accepted", f"{stats.drafted} / {stats.accepted} ({stats.acceptance_rate:.0%})"),
        ("accepted lengths", histogram(stats.accepted_lengths) or "-"),
        ("drafting", f"{1000 * stats.drafting_seconds:.1f} ms ({stats.drafting_share:.2%} of decode)"),
        ("peak memory", f"{stats.peak_memory_mb:.0f} MB"),
        ("finish", f"{finish_reason or stats.finish_reason or '-'}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def histogram(counts) -> str:
    """`0:12 1:3 4:7`: how many verifications accepted each number of drafts."""
    return " ".join(f"{length}:{count}" for length, count in sorted(counts.items()))


def split_json(sharded: str, stats, decode_traffic: tuple[int, int] | None) -> dict:
    """Under mlx.launch, `generate --json`'s "split": the ranks, how the model is split (`loaded.sharded`), and per
    generated token after the first (decoding's, as `akunu bench` counts them) the round trips between the ranks
    and the bytes this rank sent."""
    from akunu import distributed

    collectives, sent = distributed.traffic.snapshot()
    before, sent_before = decode_traffic or (collectives, sent)
    tokens = max(stats.generated_tokens - 1, 0)  # the first token comes from prefill
    return {
        "ranks": distributed.size(),
        "kind": "tensor" if sharded.startswith("tensor") else "pipeline",
        "how": sharded,
        "per_token": {
            "round_trips": (collectives - before) / tokens if tokens else None,
            "bytes_sent": (sent - sent_before) / tokens if tokens else None,
        },
    }


def result_json(model_name: str, text: str, tokens: list[int], stats, finish_reason: str | None, config) -> dict:
    """`akunu generate --json`: the engine's numbers (GenerationStats.to_dict), flat and per phase."""
    numbers = stats.to_dict()
    flat = (
        "prompt_tokens generated_tokens prefill_tps decode_tps peak_memory_mb forward_passes drafted accepted"
        " acceptance_rate tokens_per_pass"
    ).split()
    return {
        "model": model_name,
        "text": text,
        "tokens": tokens,
        **{key: numbers[key] for key in flat},
        "finish_reason": finish_reason,
        "spec": {
            "enabled": config.spec.enabled,
            "draft_tokens": config.spec.draft_tokens,
            "draft_length": config.spec.draft_length.value,
        },
        "stats": {
            "prefill": {
                "prompt_tokens": numbers["prompt_tokens"],
                "tokens": numbers["prefilled_tokens"],
                "seconds": numbers["prefill_seconds"],
                "tps": numbers["prefill_tps"],
            },
            "decode": {
                "tokens": numbers["generated_tokens"],
                "seconds": numbers["decode_seconds"],
                "tps": numbers["decode_tps"],
                "forward_passes": numbers["forward_passes"],
                "drafted": numbers["drafted"],
                "accepted": numbers["accepted"],
                "acceptance_rate": numbers["acceptance_rate"],
                "tokens_per_pass": numbers["tokens_per_pass"],
                "accepted_lengths": numbers["accepted_lengths"],
                "drafting_seconds": numbers["drafting_seconds"],
                "peak_memory_mb": numbers["peak_memory_mb"],
            },
        },
    }
