"""The linear layers of a Llama GGUF file as they are stored (Q8_0 / Q4_0 / Q4_1 blocks), fused and ordered as our
forward wants them; everything else (norms, embeddings, config, tokenizer) comes from the converted folder."""

from pathlib import Path

import numpy as np
from gguf import GGUFReader

from strata.models.compact_linear import CompactLinear
from strata.models.config import ModelConfig

# our fused module -> the GGUF tensors it stacks, in row order
LAYER_LINEARS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
                 "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}


def find_gguf(folder: Path) -> Path:
    """The one .gguf file of a model folder (the default model's folder links the file it was converted from)."""
    files = sorted(folder.glob("*.gguf"))
    if len(files) != 1:
        raise FileNotFoundError(f"--quantization gguf needs exactly one .gguf file in {folder}, found {len(files)}")
    return files[0]


def unpermute_rows(blocks: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (it interleaves each head's two rotary halves), as transformers does on import;
    rows hold whole blocks, so quantized rows move like float ones."""
    half = blocks.shape[0] // num_heads // 2
    return blocks.reshape(num_heads, half, 2, -1).swapaxes(1, 2).reshape(blocks.shape)


def gguf_linears(path: Path, cfg: ModelConfig) -> dict[str, CompactLinear]:
    """Module name -> CompactLinear for every linear layer of the file's Llama model, lm_head included (the token
    embedding when the file has no separate output matrix)."""
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(f"--quantization gguf reads Llama GGUF files; {path.name} holds a {arch!r} model")
    tensors = {t.name: t for t in reader.tensors}

    def stacked(names: list[str], module: str) -> CompactLinear:
        parts, types = [], {tensors[n].tensor_type for n in names}
        if len(types) != 1:
            raise ValueError(f"{module} mixes GGUF types {sorted(t.name for t in types)}; they cannot be fused")
        for name in names:
            blocks = np.asarray(tensors[name].data)
            if name.endswith("attn_q.weight"):
                blocks = unpermute_rows(blocks, cfg.num_heads)
            elif name.endswith("attn_k.weight"):
                blocks = unpermute_rows(blocks, cfg.num_kv_heads)
            parts.append(blocks)
        in_features = int(tensors[names[0]].shape[0])         # GGUF lists the contiguous dimension first
        return CompactLinear.from_blocks(np.concatenate(parts), types.pop(), in_features)

    out = {}
    for i in range(cfg.num_layers):
        for module, names in LAYER_LINEARS.items():
            out[f"model.layers.{i}.{module}"] = stacked([f"blk.{i}.{n}.weight" for n in names], module)
    out["lm_head"] = stacked(["output.weight" if "output.weight" in tensors else "token_embd.weight"], "lm_head")
    return out
