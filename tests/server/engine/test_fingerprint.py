"""The model fingerprint: the same files anywhere give the same id (replicas share one cache); a changed weight,
tokenizer or setting gives another."""
import json
import os
import shutil

import torch

from strata.server.engine.config import EngineConfig
from strata.server.engine.fingerprint import SAMPLE_BYTES, SAMPLES, WHOLE_BELOW, file_digest, model_fingerprint


def folder(path, weights: bytes, template: str = "{{ messages }}"):
    path.mkdir()
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    (path / "config.json").write_text("{}")
    return path


def fingerprint(path, kv_dtype="fp32", **settings) -> str:
    return model_fingerprint(EngineConfig(**settings), path, torch.float32, kv_dtype)


def test_a_copy_elsewhere_with_other_times_has_the_same_fingerprint(tmp_path):
    weights = os.urandom(WHOLE_BELOW + 3 * SAMPLE_BYTES)
    a = folder(tmp_path / "a", weights)
    b = tmp_path / "mounted" / "b"
    shutil.copytree(a, b)
    os.utime(b / "model.safetensors", ns=(1, 1))
    assert fingerprint(a) == fingerprint(b)


def test_changed_weights_tokenizer_or_settings_change_it(tmp_path):
    weights = bytearray(os.urandom(WHOLE_BELOW + SAMPLES * SAMPLE_BYTES))
    base = fingerprint(folder(tmp_path / "base", bytes(weights)))
    weights[(len(weights) - SAMPLE_BYTES) * (SAMPLES // 2) // (SAMPLES - 1) + 7] ^= 1   # a bit in a sampled block
    changed = folder(tmp_path / "tuned", bytes(weights))
    assert file_digest(changed / "model.safetensors") != file_digest(tmp_path / "base" / "model.safetensors")
    template = fingerprint(folder(tmp_path / "template", bytes(weights), template="{{ other }}"))
    assert len({base, fingerprint(changed), template, fingerprint(changed, kv_dtype="int8")}) == 4
    # the dummy seed makes no real weights: it moved every stored answer to a new partition for nothing
    assert fingerprint(changed) == fingerprint(changed, load_format="auto", dummy_weights_seed=1)
    dummy = dict(load_format="dummy", model_config="tiny-llama")
    assert fingerprint(None, **dummy) != fingerprint(None, **dummy, dummy_weights_seed=1)
