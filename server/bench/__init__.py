"""strata.server.bench: benchmarks runnable from the CLI."""
