"""What makes an engine's outputs what they are, as a short id: prefix-cache blocks and cached answers are shared only
between engines with the same one. Computed from the files' contents, not their folder or times, so that replicas
that mount or convert the same weights elsewhere share one cache, and a changed file never does."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import xxhash

from strata.server.engine.config import EngineConfig

# Files that decide the outputs besides the weights: the shape, the tokenizer and its chat template.
_TEXT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "tokenizer.model")
WHOLE_BELOW = 8 << 20       # smaller files are hashed whole
SAMPLES, SAMPLE_BYTES = 64, 64 << 10   # else: 64 blocks of 64 KiB spread over the file, the first and the last included


def file_digest(path: Path) -> str:
    """xxh3 of a file's size and contents, sampled past WHOLE_BELOW: a fine-tune or a requantization changes nearly
    every block, and 4 MiB of reads keep a start fast whatever the model's size."""
    size = path.stat().st_size
    digest = xxhash.xxh3_64(str(size).encode())
    with open(path, "rb") as f:
        if size < WHOLE_BELOW:
            digest.update(f.read())
        else:
            for i in range(SAMPLES):
                f.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def model_fingerprint(config: EngineConfig, model_path: Path | None, dtype: torch.dtype, kv_dtype: str,
                      weight_format: str = "none") -> str:
    """The weights and tokenizer by content (or the dummy shape and seed), how the weights are stored, the dtype and
    the resolved KV dtype."""
    folders = [p for p in (model_path, Path(config.tokenizer) if config.tokenizer else None) if p is not None]
    files = sorted({f for folder in folders for pattern in ("*.safetensors", "*.gguf", *_TEXT_FILES)
                    for f in folder.glob(pattern) if f.is_file()}, key=lambda f: (f.name, os.fspath(f)))
    # the dummy shape and seed only where they make the weights (a stray flag moved every stored answer elsewhere)
    dummy = [str(config.model_config), str(config.dummy_weights_seed)] if config.load_format == "dummy" else []
    ident = "|".join([config.load_format, *dummy, str(dtype),
                      kv_dtype, *([weight_format] if weight_format != "none" else []),
                      *(f"{f.name}:{file_digest(f)}" for f in files)])
    return xxhash.xxh3_64_hexdigest(ident.encode())[:12]
