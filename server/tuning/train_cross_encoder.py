"""Train the cross-encoder's adapter on labelled pairs, on CPU: the shipped cache/request/data/cross_encoder.npz comes
from here (shared data sets, TRAIN split), and `strata calibrate --fit-second-stage` continues it on a user's pairs.

Each pair is shown in a random side order per epoch (cached and query are interchangeable for "same question?"), in
length-bucketed batches (little padding); small domains can count more than once per epoch. Loss: binary
cross-entropy on the logit; AdamW (weight decay on LoRA only), linear warm-up then linear decay, gradient clip 1.
Checkpoints (ckpt.pt + adapter.npz) every `ckpt_every` steps; `resume` continues a killed run at the same step of
the same data order. Progress goes to log.jsonl (JSON lines) in the output folder.

    python -m strata.server.tuning.train_cross_encoder --datasets DIR --out runs/full     # the shipped adapter
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from strata.server.tuning.cross_encoder_torch import AdapterConfig, PairInputs, TorchCrossEncoder, collate, predict
from strata.server.tuning.hard_negatives import DEFAULT_KINDS, KINDS, hard_negatives
from strata.server.tuning.pairs import Pair

log = logging.getLogger(__name__)
ADAPTER, CHECKPOINT, LOG = "adapter.npz", "ckpt.pt", "log.jsonl"


@dataclass
class TrainConfig:
    """How to train. The defaults are the run that made the shipped adapter; with `start_from`, the adapter's own
    shape (rank, alpha, layers, n_layers, max_len) wins over the fields here."""

    epochs: float = 5.0
    batch_size: int = 32
    lr: float = 5e-4
    rank: int = 16
    alpha: float = 32.0
    n_layers: int = 12
    lora_layers: tuple[int, ...] | None = None      # None: every kept layer
    train_bias_ln: bool = True
    max_len: int = 128
    repeat: dict[str, int] = field(default_factory=lambda: {"hard_pairs": 3, "faq_pairs": 3})  # domain -> copies
    hard_negatives: tuple[str, ...] = DEFAULT_KINDS # synthetic near-miss kinds added (hard_negatives.py)
    warmup: float = 0.06                            # share of the steps spent warming up
    weight_decay: float = 0.01                      # on LoRA matrices only
    seed: int = 0
    threads: int = 2                                # torch intra-op threads; 0: torch's default (all cores)
    ckpt_every: int = 200
    eval_every: int = 500                           # steps between monitoring evaluations (0: only at the ends)
    resume: bool = False
    stop_after: int = 0                             # end the run after this step (a checkpoint is written); 0: never


def epoch_batches(pairs: list[Pair], inputs: PairInputs, config: TrainConfig, epoch: int) -> list[list[tuple]]:
    """One epoch of (ids, label) examples: random side order, grouped by length into batches, batches shuffled;
    the same for the same seed and epoch, which is what makes resuming exact."""
    rng = random.Random(config.seed * 1000 + epoch)
    examples = []
    for p in pairs:
        for _ in range(config.repeat.get(p.domain, 1)):
            a, b = (p.cached, p.query) if rng.random() < 0.5 else (p.query, p.cached)
            examples.append((inputs(a, b), float(p.same)))
    rng.shuffle(examples)
    bs, out = config.batch_size, []
    for g in range(0, len(examples), bs * 50):
        group = sorted(examples[g:g + bs * 50], key=lambda e: len(e[0]))
        out += [group[i:i + bs] for i in range(0, len(group), bs)]
    rng.shuffle(out)
    return out


def steps_per_epoch(pairs: list[Pair], config: TrainConfig) -> int:
    return math.ceil(sum(config.repeat.get(p.domain, 1) for p in pairs) / config.batch_size)


def evaluate(model: TorchCrossEncoder, pairs: list[Pair], inputs: PairInputs) -> dict[str, float]:
    """AUC per domain (for a one-class domain, the share scored on the right side of 0) and the mean AUC over the
    two-class domains: monitoring only, nothing is selected on it."""
    from sklearn.metrics import roc_auc_score

    z = predict(model, [inputs(p.cached, p.query) for p in pairs])
    out, aucs = {}, []
    for name in dict.fromkeys(p.domain for p in pairs):
        idx = [i for i, p in enumerate(pairs) if p.domain == name]
        y = np.array([pairs[i].same for i in idx])
        if 0 < y.sum() < len(y):
            out[name] = round(float(roc_auc_score(y, z[idx])), 4)
            aucs.append(out[name])
        else:
            out[name] = round(float(((z[idx] > 0) == y).mean()), 4)
    if aucs:
        out["mean_auc"] = round(float(np.mean(aucs)), 4)
    return out


def _model(config: TrainConfig, start_from: Path | None) -> TorchCrossEncoder:
    if start_from is not None:
        return TorchCrossEncoder.load_adapter(start_from)
    cfg = AdapterConfig(rank=config.rank, alpha=config.alpha, n_layers=config.n_layers, lora_layers=config.lora_layers,
                        train_bias_ln=config.train_bias_ln, max_len=config.max_len)
    with torch.random.fork_rng(devices=[]):        # a fixed initialisation without touching the caller's RNG
        torch.manual_seed(config.seed)
        return TorchCrossEncoder(cfg)


def _atomic_save(obj: dict, path: Path) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(pairs: list[Pair], out_dir: Path, config: TrainConfig, start_from: Path | None = None, *,
          monitor: list[Pair] | None = None) -> Path:
    """Train an adapter on `pairs` (fresh, or continuing the adapter file `start_from`) and return the path of the
    final adapter (out_dir/adapter.npz). `monitor`: held-out pairs scored every config.eval_every steps, logged."""
    if not pairs:
        raise ValueError("no pairs to train on")
    if config.hard_negatives:
        pairs = pairs + hard_negatives(pairs, config.hard_negatives, config.seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        return _train(pairs, out_dir, config, start_from, monitor)
    finally:
        torch.set_num_threads(threads)


def _train(pairs: list[Pair], out_dir: Path, config: TrainConfig, start_from: Path | None,
           monitor: list[Pair] | None) -> Path:
    model = _model(config, start_from).train()
    model.cfg.extra = {"train": asdict(config) | {"resume": None, "stop_after": None}, "pairs": len(pairs),
                       "start_from": start_from.name if start_from else None,
                       "start_from_extra": model.cfg.extra if start_from else None}
    inputs = PairInputs(model.cfg.max_len)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    opt = torch.optim.AdamW([{"params": [p for n, p in named if "lora_" in n], "weight_decay": config.weight_decay},
                             {"params": [p for n, p in named if "lora_" not in n], "weight_decay": 0.0}], lr=config.lr)
    per_epoch = steps_per_epoch(pairs, config)
    total = max(1, int(config.epochs * per_epoch))
    warmup = max(1, int(config.warmup * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (total - s) / max(1, total - warmup))))
    shape = {"adapter": json.loads(model.cfg.to_json()) | {"extra": None}, "total": total,  # what a checkpoint
             "pairs": len(pairs)}                                                                 # must match

    step, ckpt, adapter = 0, out_dir / CHECKPOINT, out_dir / ADAPTER
    if config.resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if state["shape"] != shape:
            raise ValueError(f"{ckpt} is from a different run (adapter shape, data size or step count differ)")
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step = state["step"]

    with (out_dir / LOG).open("a", encoding="utf-8") as log_file:
        def emit(record: dict) -> None:
            line = json.dumps(record, ensure_ascii=False)
            log.info(line)
            log_file.write(line + "\n")
            log_file.flush()

        def checkpoint() -> None:
            _atomic_save({"model": {n: p.detach().clone() for n, p in named}, "opt": opt.state_dict(),
                          "sched": sched.state_dict(), "step": step, "shape": shape}, ckpt)
            emit({"event": "ckpt", "step": step, "adapter_bytes": model.save_adapter(adapter)})

        emit({"event": "start", "train_pairs": len(pairs), "steps": total, "per_epoch": per_epoch, "from_step": step,
              "trainable": sum(p.numel() for p in params), "start_from": str(start_from) if start_from else None,
              "config": asdict(config), "adapter": json.loads(model.cfg.to_json()) | {"extra": None}})
        if monitor and step == 0:
            emit({"event": "eval", "step": 0, **evaluate(model, monitor, inputs)})
        t0, seen, losses, first = time.time(), 0, [], step
        batches, batches_epoch = [], -1
        while step < total:
            epoch, within = divmod(step, per_epoch)
            if epoch != batches_epoch:
                batches, batches_epoch = epoch_batches(pairs, inputs, config, epoch), epoch
            ids, keep = collate([x for x, _ in batches[within]])
            y = torch.tensor([label for _, label in batches[within]])
            loss = F.binary_cross_entropy_with_logits(model(ids, keep), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            seen += int(keep.sum())
            losses.append(loss.item())
            if step % 50 == 0 or step == total or step == config.stop_after:
                dt = time.time() - t0
                emit({"event": "train", "step": step, "epoch": round(step / per_epoch, 3),
                      "loss": round(float(np.mean(losses)), 4), "lr": round(sched.get_last_lr()[0], 7),
                      "tok_s": round(seen / max(dt, 1e-9)), "elapsed_s": round(dt),
                      "eta_s": round(dt / (step - first) * (total - step))})
                losses = []
            if step % config.ckpt_every == 0 or step == total or step == config.stop_after:
                checkpoint()
            if monitor and ((config.eval_every and step % config.eval_every == 0) or step == total):
                emit({"event": "eval", "step": step, **evaluate(model, monitor, inputs)})
            if step == config.stop_after and step < total:
                emit({"event": "stopped", "step": step})
                return adapter
        if not adapter.exists():                     # resumed a finished run whose adapter was removed
            checkpoint()
        emit({"event": "done", "step": step, "elapsed_s": round(time.time() - t0)})
    return adapter


def monitor_sample(pairs: list[Pair], per_domain: int, seed: int = 1) -> list[Pair]:
    """A fixed sample of at most per_domain pairs of each domain."""
    rng, out = random.Random(seed), []
    for name in dict.fromkeys(p.domain for p in pairs):
        members = [p for p in pairs if p.domain == name]
        out += rng.sample(members, min(per_domain, len(members)))
    return out


def main(argv: list[str] | None = None) -> Path:
    """Train on the shared data sets' TRAIN split (defaults: the shipped adapter's run), monitoring on VAL."""
    from strata.server.bench.data_files import datasets_dir
    from strata.server.tuning.pairs import load_shared, split_of

    d = TrainConfig()
    ap = argparse.ArgumentParser(prog="python -m strata.server.tuning.train_cross_encoder",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", type=Path, default=None, help="shared data sets (default: $STRATA_DATASETS)")
    ap.add_argument("--out", type=Path, required=True, help="folder for adapter.npz, ckpt.pt and log.jsonl")
    ap.add_argument("--epochs", type=float, default=d.epochs)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--rank", type=int, default=d.rank)
    ap.add_argument("--alpha", type=float, default=d.alpha)
    ap.add_argument("--n-layers", type=int, default=d.n_layers, help="keep the lowest N encoder layers")
    ap.add_argument("--lora-layers", default=None, help="first-last layer carrying LoRA, e.g. 8-11 (default: all)")
    ap.add_argument("--no-bias-ln", action="store_true", help="freeze biases and LayerNorms")
    ap.add_argument("--max-len", type=int, default=d.max_len)
    ap.add_argument("--repeat", default=",".join(f"{k}={v}" for k, v in d.repeat.items()),
                    help="domain=copies per epoch, comma-separated")
    ap.add_argument("--hard-negatives", default=",".join(d.hard_negatives),
                    help=f"synthetic near-miss kinds to add, comma-separated ({', '.join(KINDS)}; empty: none)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--ckpt-every", type=int, default=d.ckpt_every)
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--eval-per-set", type=int, default=250, help="VAL pairs per domain in the monitoring sample")
    ap.add_argument("--subset", type=int, default=0, help="train on a random subset of this many pairs (a pilot)")
    ap.add_argument("--start-from", type=Path, default=None, help="continue this adapter file")
    ap.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    ap.add_argument("--stop-after", type=int, default=0, help="end after this step (resume later)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    lora_layers = None
    if a.lora_layers:
        first, last = map(int, a.lora_layers.split("-"))
        lora_layers = tuple(range(first, min(last, a.n_layers - 1) + 1))
    repeat = {k: int(v) for k, v in (item.split("=") for item in a.repeat.split(",") if item)}
    config = TrainConfig(epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, rank=a.rank, alpha=a.alpha,
                         n_layers=a.n_layers, lora_layers=lora_layers, train_bias_ln=not a.no_bias_ln,
                         max_len=a.max_len, repeat=repeat, seed=a.seed,
                         hard_negatives=tuple(k for k in a.hard_negatives.split(",") if k), threads=a.threads,
                         ckpt_every=a.ckpt_every, eval_every=a.eval_every, resume=a.resume, stop_after=a.stop_after)
    pairs = load_shared(datasets_dir(a.datasets))
    split = split_of(pairs)
    train_pairs = [p for p, s in zip(pairs, split, strict=True) if s == "train"]
    if a.subset:
        train_pairs = random.Random(a.seed).sample(train_pairs, min(a.subset, len(train_pairs)))
    val = [p for p, s in zip(pairs, split, strict=True) if s == "val"]
    monitor = monitor_sample(val, a.eval_per_set) if a.eval_per_set else None
    path = train(train_pairs, a.out, config, a.start_from, monitor=monitor)
    print(json.dumps({"adapter": str(path)}))
    return path


if __name__ == "__main__":
    main()
