"""Strata: a paged-KV inference engine with exact and semantic response caches in one process."""

__version__ = "0.1.0"
