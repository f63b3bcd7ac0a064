"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) whose attention reads and writes the paged KV cache."""

import functools

import torch
from torch import nn

from strata.kernels import AttentionBackend, AttentionMetadata, LayerKV
from strata.kernels.cpu.decode_stack import DecodeStack, StackLayer
from strata.kernels.layer_ops import LayerOps
from strata.models.compact_linear import CompactLinear
from strata.models.config import ModelConfig
from strata.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """An RMSNorm's weight; the math is the backend's (kernels/layer_ops.py), in fp32 like the reference."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of x + residual, x + residual): a pre-norm block's seam."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """GQA attention: q/k/v in one matmul; only the KV heads are stored in the cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv: LayerKV, meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = backend.ops.rope(q, k, *rope)
        backend.write_kv(k, v, kv, meta.slot_mapping)
        num_prefill = meta.num_prefill_tokens
        if num_prefill == q.shape[0]:
            out = backend.prefill(q, kv, meta, self.scale)
        elif num_prefill == 0:
            out = backend.decode(q, kv, meta.decode_block_tables, meta.decode_context_lens, self.scale)
        else:
            out = torch.cat([
                backend.prefill(q[:num_prefill], kv, meta, self.scale),
                backend.decode(q[num_prefill:], kv, meta.decode_block_tables, meta.decode_context_lens, self.scale),
            ])
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    """SwiGLU with gate and up projections fused into one matmul."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope, x, residual, kv, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, added to the running residual here (the first layer: the embeddings,
        residual None); returns this layer's MLP output and the residual before it."""
        ops = backend.ops
        if residual is None:
            h, residual = self.input_layernorm(x, ops), x
        else:
            h, residual = self.input_layernorm.add(x, residual, ops)
        h, residual = self.post_attention_layernorm.add(self.self_attn(rope, h, kv, meta, backend), residual, ops)
        return self.mlp(h, ops), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.rope = RotaryEmbedding(cfg, max_positions)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Token ids of a flat, mixed prefill/decode batch in; hidden states out; logits only for rows asked."""

    def __init__(self, cfg: ModelConfig, max_model_len: int):
        super().__init__()
        self.config = cfg
        self.max_model_len = max_model_len       # positions the rotary table covers: the engine's context length
        self.model = LlamaModel(cfg, max_model_len)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_layers: list[LayerKV],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rope.lookup(positions, x.dtype)
        if backend.decode_stack and DecodeStack.accepts(x, kv_layers, meta) and self.decode_stack is not None:
            return self.decode_stack(x, rope, kv_layers, meta)
        residual = None
        for layer, kv in zip(self.model.layers, kv_layers, strict=True):
            x, residual = layer(rope, x, residual, kv, meta, backend)
        return self.model.norm.add(x, residual, backend.ops)[0]

    @functools.cached_property
    def decode_stack(self) -> DecodeStack | None:
        """The whole decoder as one C++ call for pure-decode steps (kernels/cpu/decode_stack.py), built on first use;
        None when a layer's linears are not all compact weights on CPU (dense weights keep the layer-by-layer path)."""
        layers = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(m, CompactLinear) and m.weight.device.type == "cpu" for m in linears):
                return None
            layers.append(StackLayer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                     tuple((m.format, m.weight, m.scales, m.mins, m.bias, m.in_features)
                                           for m in linears)))
        attn = self.model.layers[0].self_attn
        return DecodeStack(layers, self.model.norm.weight, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                           self.model.norm.eps, attn.scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
