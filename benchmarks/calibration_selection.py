"""How often does the error-bound rule certify a threshold when no threshold meets the bound? A simulation of the
selection effect: calibration takes the lowest of many thresholds whose own Clopper-Pearson bound passes, so its
95% confidence is per threshold, not for the one chosen.

    .venv/bin/python benchmarks/calibration_selection.py     # writes results/calibration_selection.json

Scores carry no information (labels independent of them) and the false share is the same at every threshold, just
above the bound D: a valid 95% rule certifies in at most 5% of trials.
"""
import json
from pathlib import Path

import numpy as np

from strata.cache.request.calibration import certified, cp_upper

OUT = Path(__file__).parent / "results" / "calibration_selection.json"


def main(bound: float = 0.02, trials: int = 1000) -> None:
    rng = np.random.default_rng(0)
    rows = []
    for false_share in (0.021, 0.025, 0.03):
        for pairs in (1000, 3000):
            chosen = one_fixed = 0
            for _ in range(trials):
                score = rng.permutation(pairs).astype(float)
                same = rng.random(pairs) > false_share
                chosen += bool(np.isfinite(certified(score, same, np.array(["a"] * pairs), bound)))
                one_fixed += bool(cp_upper((~same).sum(), pairs) <= bound)    # one threshold fixed beforehand
            rows.append({"true_false_share": false_share, "pairs": pairs, "trials": trials,
                         "certified_share": chosen / trials, "one_fixed_threshold_share": one_fixed / trials})
            print(json.dumps(rows[-1]), flush=True)
    OUT.write_text(json.dumps({"bound": bound, "confidence": 0.95, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
