"""Adapt the shipped cross-encoder to a user's own labelled pairs (`strata calibrate --fit-second-stage`).

Only the pairs' TRAIN part (pairs.split_of) is trained on; the calib and val parts are held out, so the tiers
calibrated afterwards are certified on pairs the new adapter has never seen. Training continues the shipped
adapter at a lower learning rate rather than starting over: a user's few hundred pairs would not retrain it.
"""
from __future__ import annotations

from pathlib import Path

from strata.cache.request.cross_encoder import ADAPTER_PATH
from strata.server.tuning.pairs import Pair, split_of
from strata.server.tuning.train_cross_encoder import TrainConfig, train

# Continue, don't retrain: fewer epochs, a fifth of the full run's learning rate, every domain counted once, the
# user's own pairs only (no synthetic negatives: the shipped adapter has learned those), all cores (the user's own
# machine, not the shared build host the shipped run was made on).
FIT_CONFIG = TrainConfig(epochs=2.0, batch_size=16, lr=1e-4, repeat={}, hard_negatives=(), threads=0, ckpt_every=100,
                         eval_every=0)


def split_for_fit(pairs: list[Pair]) -> tuple[list[Pair], list[Pair]]:
    """(fit, held_out): the train split, and calib + val together (what calibration should then score)."""
    split = split_of(pairs)
    fit = [p for p, s in zip(pairs, split, strict=True) if s == "train"]
    held_out = [p for p, s in zip(pairs, split, strict=True) if s != "train"]
    return fit, held_out


def fit_second_stage(pairs: list[Pair], out_dir: Path, config: TrainConfig = FIT_CONFIG,
                     start_from: Path = ADAPTER_PATH) -> Path:
    """Train `start_from` (the shipped adapter) further on the train part of `pairs`; returns the new adapter's
    path (out_dir/adapter.npz). A run killed part-way continues with config.resume=True."""
    fit, held_out = split_for_fit(pairs)
    labels = {p.same for p in fit}
    if labels != {True, False}:
        raise ValueError(f"the train part of the pairs ({len(fit)} of {len(pairs)}) needs both same and different "
                         "pairs to fit the second stage on; give more labelled pairs")
    # the held-out part is scored before and after (log.jsonl's eval events): monitoring only, nothing is chosen on it
    return train(fit, out_dir, config, start_from, monitor=held_out or None)
