"""`akunu bench` as a library: workloads, the interleaved runner, statistics and result records.

The command line (`cli/bench.py`) draws tables and progress; nothing here imports typer or
rich, and the runner takes its engine as a parameter so tests can run it without a model.
"""

from akunu.bench.runner import (
    LLAMA_CPP,
    METHODS,
    MLX_LM,
    PLAIN,
    PLAIN_EXACT,
    SPEC,
    SPEC_EXACT,
    SPEC_FIXED,
    BenchResult,
    Engine,
    Measurement,
    Mismatch,
    Run,
    drafter_method,
    method_order,
    run_benchmark,
)
from akunu.bench.summary import (
    CategorySummary,
    DrafterSummary,
    ExactSummary,
    median_of_ratios,
    summarize,
    summarize_drafters,
    summarize_exact,
)  # fmt: skip
from akunu.bench.workloads import CATEGORIES, Prompt, WorkloadError, load_workload, select, shipped_workload

__all__ = [
    "CATEGORIES",
    "LLAMA_CPP",
    "METHODS",
    "MLX_LM",
    "PLAIN",
    "PLAIN_EXACT",
    "SPEC",
    "SPEC_EXACT",
    "SPEC_FIXED",
    "BenchResult",
    "CategorySummary",
    "DrafterSummary",
    "ExactSummary",
    "Engine",
    "Measurement",
    "Mismatch",
    "Prompt",
    "Run",
    "WorkloadError",
    "drafter_method",
    "load_workload",
    "median_of_ratios",
    "method_order",
    "run_benchmark",
    "select",
    "shipped_workload",
    "summarize",
    "summarize_drafters",
    "summarize_exact",
]
