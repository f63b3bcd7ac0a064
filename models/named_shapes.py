"""Hugging Face configs of real models, so `--load-format dummy` can build their shapes without any file."""

from typing import Any

_LLAMA3_ROPE_1B = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA3_ROPE_8B = dict(_LLAMA3_ROPE_1B, factor=8.0)

NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "SmolLM2-135M": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
    "Llama-3.2-1B": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_scaling=_LLAMA3_ROPE_1B, rope_theta=500000.0, max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
    ),
    "Llama-3.1-8B": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_scaling=_LLAMA3_ROPE_8B, rope_theta=500000.0, max_position_embeddings=131072,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
    ),
    "Qwen2.5-0.5B": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645,
    ),
    # Tiny shapes for tests: small enough to run against transformers in seconds.
    "tiny-llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    ),
    "tiny-qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=512, hidden_size=96,
        intermediate_size=160, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
}


def hf_config_for(name: str) -> Any:
    """A transformers config object of a named shape (raises with the list of names when unknown)."""
    if name not in NAMED_SHAPES:
        raise ValueError(f"unknown model config {name!r}; known: {', '.join(NAMED_SHAPES)}")
    from transformers import AutoConfig

    params = dict(NAMED_SHAPES[name])
    return AutoConfig.for_model(params.pop("model_type"), **params)
