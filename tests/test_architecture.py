"""Arrows point down only (../shared/ARCHITECTURE.md): every import of every module, lazy ones included, is checked
against what its folder may import."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# folder (relative to the package root) -> strata subpackages its modules may import (besides their own folder)
ALLOWED = {
    "kernels": {"strata.kernels"},
    "models": {"strata.models", "strata.kernels"},
    "cache/kv": {"strata.cache.kv", "strata.kernels"},
    "cache/request": {"strata.cache.request"},
    "server/engine": {"strata.server.engine", "strata.cache.kv", "strata.models", "strata.kernels"},
    "server/api": {"strata.server.api", "strata.server.engine", "strata.cache.request"},
}


def strata_imports(path: Path) -> set[str]:
    """Absolute names of the strata modules a file imports (relative imports resolved against its package)."""
    package = ["strata", *path.parent.relative_to(ROOT).parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names |= {f"{base}.{alias.name}" if base == "strata" else base for alias in node.names}
    return {n for n in names if n == "strata" or n.startswith("strata.")}


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_each_folder_imports_only_what_it_may(folder):
    allowed = ALLOWED[folder]
    files = modules(folder)
    assert files, f"no modules under {folder}"
    wrong = {f"{path.relative_to(ROOT)} imports {name}"
             for path in files for name in strata_imports(path)
             if not any(name == a or name.startswith(a + ".") for a in allowed)}
    assert not wrong, sorted(wrong)


def test_engine_never_imports_the_http_layer_and_caches_never_import_the_server():
    engine = {n for p in modules("server/engine") for n in strata_imports(p)}
    cache = {n for p in modules("cache") for n in strata_imports(p)}
    assert not any(n.startswith("strata.server.api") for n in engine)
    assert not any(n.startswith("strata.server") for n in cache)


def test_the_checker_sees_lazy_and_relative_imports():
    """The oracle itself: an import inside a function and a relative import are both found."""
    names = strata_imports(ROOT / "cache" / "request" / "semantic.py")
    assert "strata.cache.request.embedders" in names          # `from .embedders import ...` (relative, lazy)
    assert "strata.cache.request.calibration" in names
