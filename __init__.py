"""Strata: a paged-KV inference engine with exact and semantic response caches in one process."""

import os

# Before torch loads OpenMP: threads that spin at barriers stall whenever a peer is descheduled, and a server's CPU
# is shared (HTTP process, embedder, other jobs). Measured on 2 cores with one competing process: decode attention
# 130-490 ms per layer spinning vs 9-10 ms sleeping; see README "CPU threads".
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
