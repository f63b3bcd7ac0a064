"""Test setup: Triton runs in interpreter mode on CPU; nothing is ever fetched from a model hub."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted from the shipped GGUF on first use)."""
    from strata.models.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Llama and Qwen2 checkpoints saved by transformers: the oracle and our loader read the same files."""
    from transformers import AutoModelForCausalLM

    from strata.models.named_shapes import hf_config_for

    dirs = {}
    for name in ("tiny-llama", "tiny-qwen2"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config_for(name), dtype=torch.float32)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, safe_serialization=True)
        dirs[name] = path
    return dirs


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random Llama with the default model's vocabulary, tokenizer and chat template: the whole HTTP path
    (templating, tokenizing, validation, engine, detokenizing) at a few milliseconds per step, for fuzz and load."""
    import shutil

    from transformers import AutoModelForCausalLM

    from strata.models.named_shapes import hf_config_for

    config = hf_config_for("tiny-llama")
    config.vocab_size, config.bos_token_id, config.eos_token_id = 49152, 1, 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny-chat")
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_chat_engine(tiny_chat_model_dir):
    """The engine config of the tiny chat model, for tests of the serving path rather than of the model's answers:
    an engine process starts in about a second instead of loading SmolLM2's 540 MB."""
    from strata.server.engine.config import EngineConfig

    return EngineConfig(model=str(tiny_chat_model_dir), dtype="fp32", kv_cache_memory="64MiB", max_model_len=512)
