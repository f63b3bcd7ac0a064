"""Pairwise semantic-cache quality on the VALIDATION split of every shared data set (never trained or calibrated
on), with `strata serve`'s semantic layer at the default error bound and at looser ones: one JSON per set and a PNG
of precision vs hit rate per set.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/semantic_quality.py --out benchmarks/results/semantic_quality
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from strata.cache.request.config import RequestCacheConfig
from strata.server.bench.cache_quality import Seen, run_cache_quality
from strata.server.bench.data_files import DATASETS_ENV, datasets_dir
from strata.server.tuning.pairs import SHARED_FILES


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 6))
    first = next(iter(results))
    for name, result in results.items():
        for lang, curve in result["pairwise"]["curve"].items():
            points = curve.get("points") or []
            if points:
                line, = ax.plot([p[0] for p in points], [p[1] for p in points], label=f"{name} ({lang})")
                base = result["pairwise"]["cosine_curve"][lang].get("points") or []
                ax.plot([p[0] for p in base], [p[1] for p in base], color=line.get_color(), linestyle=":",
                        linewidth=1, label="cosine alone (dotted)" if name == first else None)
                for bound, marker in zip(result["max_errors"], "os^D", strict=False):
                    served = result["by_max_error"][bound][lang]
                    if served["hit_rate"] is not None and served["precision"] is not None:
                        ax.scatter([served["hit_rate"]], [served["precision"]], color=line.get_color(), zorder=3,
                                   marker=marker, label=f"--semantic-max-error {bound}" if name == first else None)
    ax.axhline(0.97, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("hit rate (positives served)")
    ax.set_ylabel("precision of what is served")
    ax.set_ylim(0.3, 1.005)
    ax.set_title("Pairwise, validation split: best thresholds in hindsight (lines), certified operating points (marks)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", help=f"default: ${DATASETS_ENV}, else ../shared/datasets")
    ap.add_argument("--split", default="val")
    ap.add_argument("--out", type=Path, required=True, help="folder for <set>.json and semantic_quality.png")
    ap.add_argument("--full-cache", action="store_true", help="also the full-cache protocol (slower)")
    ap.add_argument("--max-errors", default="0.02,0.05,0.1",
                    help="error bounds to run; the first is the one in each file's top-level 'pairwise'")
    args = ap.parse_args()
    if args.datasets:
        os.environ[DATASETS_ENV] = args.datasets
    data = datasets_dir()
    args.out.mkdir(parents=True, exist_ok=True)
    bounds = [float(b) for b in args.max_errors.split(",")]
    results, seen = {}, Seen()
    for name in SHARED_FILES:
        result, by_bound = {}, {}
        for bound in bounds:
            config = RequestCacheConfig(semantic_max_error=bound)
            run = run_cache_quality(data / name, None, config, split=args.split,
                                    full_cache=args.full_cache and not result, seen=seen)
            result = result or run
            by_bound[str(bound)] = {k: v for k, v in run["pairwise"].items() if k != "curve"}
            by_bound[str(bound)]["operating_point"] = run["operating_point"]
            print(name, bound, json.dumps({k: run["pairwise"][k] for k in ("all", "zh", "en") if k in run["pairwise"]}))
        result.update(max_errors=list(by_bound), by_max_error=by_bound)
        results[name.split(".")[0]] = result
        (args.out / f"{name.split('.')[0]}.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    plot(results, args.out / "semantic_quality.png")


if __name__ == "__main__":
    main()
