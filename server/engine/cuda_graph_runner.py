"""CUDA graphs for pure-decode steps: one graph per batch-size bucket, replayed over static input buffers.

A decode step of a small model is a few hundred tiny kernel launches; replaying them as one graph removes the
host launch cost that otherwise dominates small-batch decode. A step of B sequences runs in the smallest bucket
>= B; the padding rows write their K/V into a scratch block no sequence owns and read one key from it, so they can
never touch another sequence's cache. Off CUDA (tests) the same padded path runs eagerly.
"""

import torch

from strata.cache.kv.storage import KVStorage
from strata.kernels import AttentionBackend, AttentionMetadata
from strata.models.llama import LlamaForCausalLM
from strata.server.engine.config import EngineConfig


def captures_decode_graphs(config: EngineConfig, device: torch.device, backend: AttentionBackend) -> bool:
    """Graphs need CUDA and a backend without host syncs: the torch reference reads context lengths on the host."""
    return device.type == "cuda" and not config.enforce_eager and backend.name == "triton"


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, ... below max_num_seqs, then max_num_seqs itself, so every decode batch has a bucket."""
    buckets = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return buckets + [max_num_seqs]


class DecodeGraphs:
    """Static decode buffers for up to max(buckets) sequences, and (once `capture` ran) one graph per bucket.
    `dtype` is the activations' (the engine's math dtype): compact Q8_0 / Q4 layers hold integer codes, so no
    layer's weight dtype says what the model computes in."""

    def __init__(self, model: LlamaForCausalLM, kv: KVStorage, backend: AttentionBackend, max_num_seqs: int,
                 max_model_len: int, scratch_block: int, dtype: torch.dtype):
        self.model = model
        self.kv = kv
        self.backend = backend
        self.buckets = decode_buckets(max_num_seqs)
        block_size = kv.layout.block_size
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        size, device = self.buckets[-1], kv.device
        # The table width is the longest sequence's, fixed, so every kernel's grid is the same at each replay.
        self.max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), self.scratch_slot, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = torch.full((size, self.max_blocks), scratch_block, dtype=torch.int32, device=device)
        no_ints = torch.zeros(0, dtype=torch.int32, device=device)
        self.no_prefill = (torch.zeros(1, dtype=torch.int32, device=device), no_ints, no_ints.view(0, 0))
        self.hidden = torch.zeros(size, model.config.hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def bucket_for(self, num_seqs: int, table_width: int) -> int | None:
        """The smallest bucket holding num_seqs, or None (run eagerly) when none does or the tables are wider."""
        if table_width > self.max_blocks:
            return None
        return next((b for b in self.buckets if b >= num_seqs), None)

    def run(self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Copy a decode batch into the static buffers, pad it to `bucket`, replay (or run eagerly); hidden [B, H]."""
        n, width = meta.decode_block_tables.shape
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        # Rows n: may hold an earlier, larger batch's slots: point them back at the scratch block.
        self.slot_mapping[n:bucket].fill_(self.scratch_slot)
        self.context_lens[n:bucket].fill_(1)
        self.block_tables[n:bucket].fill_(self.scratch_block)
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self.forward(bucket)
        return self.hidden[:n]

    def forward(self, bucket: int) -> None:
        """The model over the first `bucket` rows of the static buffers: what each graph records."""
        cu_seqlens_q, prefill_lens, prefill_tables = self.no_prefill
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            num_prefill_tokens=0,
            prefill_cu_seqlens_q=cu_seqlens_q,
            prefill_context_lens=prefill_lens,
            prefill_block_tables=prefill_tables,
            decode_context_lens=self.context_lens[:bucket],
            decode_block_tables=self.block_tables[:bucket],
            prefill_cu_seqlens_q_host=[0],
            prefill_context_lens_host=[],
        )
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv.layers, meta, self.backend)
        self.hidden[:bucket].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per bucket, largest first so the smaller ones fit in the memory pool it leaves.

        Each bucket runs once eagerly first: Triton compiles its kernels for that launch outside the capture.
        """
        pool = None
        for bucket in reversed(self.buckets):
            self.forward(bucket)
            torch.cuda.synchronize(self.kv.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.forward(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.kv.device)
