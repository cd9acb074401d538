"""The `--draft` spec strings (parsed by `akunu.drafters.make_drafter`), in a module light
enough for the CLI to show them in its help without loading MLX."""

DEFAULT_SPEC = "suffix+ngram"
SPEC_HELP = "ngram, lookup, suffix, model:NAME|PATH, layer-skip:N, A+B, hybrid:SPEC or tree:N"
