"""strata.server: the engine, the HTTP API, the benchmarks and the command line."""
