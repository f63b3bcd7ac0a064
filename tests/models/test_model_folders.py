"""Model folders that are not what they claim: each a ValueError naming what is wrong, never a model served wrongly
or a library traceback (found by an audit: gelu served through SiLU, a GPT-2 config read as Llama, a corrupt file's
"header too large" naming no file)."""
import json
import shutil

import pytest
import torch

from strata.models.config import ModelConfig
from strata.models.loader import load_model
from strata.models.named_shapes import hf_config_for


def broken_copy(tmp_path, tiny_model_dirs, edit_config=None, edit_weights=None):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["tiny-llama"], folder)
    if edit_config:
        config = json.loads((folder / "config.json").read_text())
        edit_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    if edit_weights:
        edit_weights(folder / "model.safetensors")
    return folder


def load(folder):
    return load_model(folder, "auto", None, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("edit, says", [
    (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda c: (c.pop("architectures"), c.update(model_type="gpt2")), "model_type 'gpt2' is not supported"),
    (lambda c: c.update(intermediate_size=2 * c["intermediate_size"]), "model.safetensors: model.layers.0.mlp"),
])
def test_a_config_the_forward_pass_would_not_honour_is_refused(tmp_path, tiny_model_dirs, edit, says):
    with pytest.raises(ValueError, match=says):
        load(broken_copy(tmp_path, tiny_model_dirs, edit_config=edit))


@pytest.mark.parametrize("damage", [lambda b: b[:len(b) // 2], lambda b: b"\x00" * 100])
def test_a_damaged_weights_file_is_named(tmp_path, tiny_model_dirs, damage):
    def edit(path):
        path.write_bytes(damage(path.read_bytes()))

    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        load(broken_copy(tmp_path, tiny_model_dirs, edit_weights=edit))


def test_a_config_without_architectures_is_read_by_its_model_type():
    hf = hf_config_for("tiny-qwen2")
    hf.architectures = None
    assert ModelConfig.from_hf(hf).architecture == "qwen2"


def test_a_sliding_window_shorter_than_the_context_bounds_the_context(caplog):
    """Full attention within the window is the model's own attention; past it, it is not."""
    hf = hf_config_for("tiny-llama")
    hf.architectures, hf.sliding_window = ["MistralForCausalLM"], 256
    with caplog.at_level("WARNING"):
        assert ModelConfig.from_hf(hf).max_position_embeddings == 256
    assert "sliding window of 256 tokens" in caplog.text


def test_a_conversion_that_another_process_finished_first_uses_its_folder(tmp_path, monkeypatch):
    """Two servers converting the default model at once: the second failed with "Directory not empty" although the
    model was there."""
    import transformers

    from strata.models import default_model

    target = tmp_path / "models" / "SmolLM2-135M-Instruct"

    class Converted:
        """What transformers gives back, saving as it does; the other process's folder appears meanwhile."""

        config = object()
        hf_quantizer = None

        def save_pretrained(self, folder, **_):
            (folder / "config.json").write_text("{}")
            target.mkdir(parents=True)
            (target / "config.json").write_text('{"by": "the other process"}')

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: type(
        "Tokenizer", (), {"save_pretrained": lambda self, folder: None})())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Converted())
    default_model.convert_gguf(tmp_path / "model.gguf", target)
    assert (target / "config.json").read_text() == '{"by": "the other process"}'
    assert [p.name for p in target.parent.iterdir()] == [target.name]           # no staging folder left
