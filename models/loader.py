"""Build a model from a local Hugging Face folder (safetensors) or as random weights of a named shape."""

import logging
from pathlib import Path

import torch
from torch import nn

from strata.models.compact_linear import CompactLinear
from strata.models.config import ModelConfig
from strata.models.gguf_weights import find_gguf, gguf_linears
from strata.models.llama import LlamaForCausalLM
from strata.models.named_shapes import hf_config_for
from strata.models.packed_linear import can_pack, pack_linears

LOAD_FORMATS = ("auto", "dummy")
log = logging.getLogger(__name__)


def read_config(path: Path) -> ModelConfig:
    """Read config.json of a local model folder (clear error when the folder is not a model)."""
    from transformers import AutoConfig

    if path.suffix == ".gguf" and path.is_file():
        raise FileNotFoundError(f"model path {path} is a GGUF file: point --model at its folder, which needs the "
                                "config.json and safetensors converted from it (--quantization gguf then serves the "
                                "folder's .gguf blocks as they are)")
    if not path.is_dir():
        raise FileNotFoundError(f"model path {path} does not exist or is not a folder")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model folder {path} has no config.json")
    return ModelConfig.from_hf(AutoConfig.from_pretrained(path), name=path.name)


def load_model(
    path: Path | None,
    load_format: str,
    model_config: str | None,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None = None,
    seed: int = 0,
    weight_format: str = "none",
) -> LlamaForCausalLM:
    """Instantiate our forward and fill it: from safetensors, or random (dummy) weights of a named real shape.
    max_model_len (None = the model's own) sizes the rotary table; it never exceeds the model's own.
    weight_format other than none keeps the linear layers compact (see compact_linears)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose one of {LOAD_FORMATS}")
    if load_format == "dummy":
        if model_config is None:
            raise ValueError("--load-format dummy needs --model-config NAME")
        cfg = ModelConfig.from_hf(hf_config_for(model_config), name=model_config)
    else:
        cfg = read_config(path)
    if max_model_len and max_model_len > cfg.max_position_embeddings:
        log.warning("max_model_len %d is past the %d positions %s was trained for: serving %d", max_model_len,
                    cfg.max_position_embeddings, cfg.name, cfg.max_position_embeddings)
    max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    with torch.device(device):
        model = LlamaForCausalLM(cfg, max_model_len).to(dtype)
    model.eval().requires_grad_(False)
    if load_format == "dummy":
        fill_random(model, seed)
    else:
        load_safetensors(model, path)
    if weight_format != "none":
        compact_linears(model, weight_format, path)
    if can_pack(dtype, device):
        pack_linears(model)
    return model


def compact_linears(model: LlamaForCausalLM, weight_format: str, path: Path | None) -> None:
    """Replace every nn.Linear (lm_head too, which unties it from the embedding) by a CompactLinear: f16, bf16, int8 or int4
    made from the loaded float weights, or gguf: the blocks of the folder's .gguf file as they are."""
    if weight_format == "gguf":
        if path is None:
            raise ValueError("--quantization gguf needs a model folder with its .gguf file, not dummy weights")
        replacements = gguf_linears(find_gguf(path), model.config)
    else:
        # int4 keeps lm_head (the tied embedding in small models) at int8, as llama.cpp's 4-bit files do: at 4 bits
        # it alone cost SmolLM2-135M 7% perplexity, while its other layers lost nothing measurable
        replacements = {name: CompactLinear.from_linear(module, "int8" if weight_format == "int4" and
                                                        name == "lm_head" else weight_format)
                        for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    for name, layer in replacements.items():
        dense = model.get_submodule(name).weight
        shape = tuple(dense.shape)
        if (layer.weight.shape[0], layer.in_features) != shape:
            raise ValueError(f"{name}: the .gguf file holds [{layer.weight.shape[0]}, {layer.in_features}] where the "
                             f"model folder has {list(shape)}; they are not the same model")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer.to(dense.device))   # blocks are made on the CPU


def fill_random(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights with a real checkpoint's scale, so activations stay finite in bf16."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)


def load_safetensors(model: LlamaForCausalLM, path: Path) -> None:
    """Copy HF tensors into our modules, fusing q/k/v and gate/up on the way. A file that is not safetensors, or a
    tensor whose shape is not the parameter's (copy_ would broadcast [1, N] into [M, N]), is a ValueError naming it."""
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {path} has no *.safetensors files")
    params = dict(model.named_parameters())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    loaded: set[str] = set()
    fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    tensor = f.get_tensor(key)
                    module, _, leaf = key.rpartition(".")
                    parent, _, proj = module.rpartition(".")
                    if proj in fused:
                        target, index = fused[proj]
                        name = f"{parent}.{target}.{leaf}"
                        parts = pending.setdefault(name, {})
                        parts[index] = tensor
                        if len(parts) < (3 if target == "qkv_proj" else 2):
                            continue
                        try:
                            tensor = torch.cat([parts[i] for i in sorted(parts)])
                        except RuntimeError:
                            raise ValueError(f"{file}: the parts of {name} have shapes that do not join: "
                                             f"{[tuple(parts[i].shape) for i in sorted(parts)]}") from None
                        del pending[name]
                    else:
                        name = key
                    if name == "lm_head.weight" and model.config.tie_word_embeddings:
                        continue
                    if name not in params:
                        raise ValueError(f"unexpected tensor {key} in {file.name}")
                    if tensor.shape != params[name].shape:
                        raise ValueError(f"{file}: {name} has shape {tuple(tensor.shape)}, the model's config.json "
                                         f"makes it {tuple(params[name].shape)}")
                    params[name].copy_(tensor)
                    loaded.add(name)
        except SafetensorError as exc:
            raise ValueError(f"{file} is not a readable safetensors file ({exc})") from None
    missing = set(params) - loaded - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    if missing or pending:
        raise ValueError(f"checkpoint in {path} lacks tensors: {sorted(missing | set(pending))[:5]}")
