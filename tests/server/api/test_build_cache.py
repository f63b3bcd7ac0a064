"""The request cache `strata serve` builds: a calibration file the operator named must load, or the server does not
start; without one, a semantic layer that cannot load degrades to exact-only."""
import numpy as np
import pytest

from strata.cache.request.config import RequestCacheConfig
from strata.server.api.server import build_cache


@pytest.mark.parametrize("name", ["missing.npz", "other.npz"])
def test_a_named_calibration_file_that_does_not_load_stops_the_start(tmp_path, name):
    np.savez(tmp_path / "other.npz", a=np.arange(3))
    with pytest.raises(ValueError, match=f"--semantic-calibration {tmp_path / name}"):
        build_cache(RequestCacheConfig(db=None, semantic_calibration=str(tmp_path / name)))


def test_without_a_named_file_a_semantic_layer_that_cannot_load_degrades(caplog, monkeypatch):
    from strata.cache.request.semantic import SemanticCache

    def unreadable(cls, config):
        raise OSError("model file unreadable")

    monkeypatch.setattr(SemanticCache, "from_config", classmethod(unreadable))
    cache = build_cache(RequestCacheConfig(db=None))
    assert cache.semantic is None and "semantic cache off (OSError: model file unreadable)" in caplog.text


def test_an_unknown_embedder_is_a_configuration_error():
    """A typo served exact-only with a warning; `strata calibrate --embedder` refused it."""
    with pytest.raises(ValueError, match="embedder 'no-such-embedder' is unknown"):
        RequestCacheConfig(db=None, embedder="no-such-embedder")


def test_a_store_held_by_another_server_is_refused_before_the_embedders_load(tmp_path, monkeypatch):
    from strata.cache.request.semantic import SemanticCache

    first = build_cache(RequestCacheConfig(db=str(tmp_path / "c.db"), embedder="none"))
    loaded = []
    monkeypatch.setattr(SemanticCache, "from_config", classmethod(lambda cls, config: loaded.append(config)))
    try:
        with pytest.raises(ValueError, match="in use by pid"):
            build_cache(RequestCacheConfig(db=str(tmp_path / "c.db")))
        assert not loaded                               # seconds of embedder loading, then the refusal: no more
    finally:
        first.close()
        monkeypatch.undo()
    with pytest.raises(ValueError, match="--semantic-calibration"):     # a start refused later gives the file up
        build_cache(RequestCacheConfig(db=str(tmp_path / "c.db"), semantic_calibration=str(tmp_path / "no.npz")))
    build_cache(RequestCacheConfig(db=str(tmp_path / "c.db"), embedder="none")).close()
