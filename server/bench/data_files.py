"""Where the benches find their data: files shipped inside the package, and the shared pair datasets."""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import strata

DATASETS_ENV = "STRATA_DATASETS"


def packaged(name: str) -> Path:
    """A data file shipped with `strata.server.bench` (works from a source tree and after `pip install .`)."""
    return Path(str(resources.files("strata.server.bench").joinpath("data", name)))


def datasets_dir(explicit: str | Path | None = None) -> Path:
    """The shared pair datasets: `explicit` (a flag), else $STRATA_DATASETS, else ../shared/datasets beside the
    repository (a source checkout); FileNotFoundError naming all three when none exists."""
    source = explicit or os.environ.get(DATASETS_ENV)
    path = Path(source) if source else Path(strata.__file__).resolve().parent.parent / "shared" / "datasets"
    if not path.is_dir():
        raise FileNotFoundError(f"no datasets folder at {path}: pass --datasets DIR or set ${DATASETS_ENV}")
    return path
