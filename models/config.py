"""Our own view of a Llama-family config, read from a Hugging Face config or a named real shape."""

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """The shape numbers the forward pass needs; nothing else from transformers reaches run time."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")

    @classmethod
    def from_hf(cls, hf: Any, name: str = "") -> "ModelConfig":
        """Translate a transformers PretrainedConfig (v4 or v5 field names)."""
        archs = getattr(hf, "architectures", None) or [_BY_MODEL_TYPE.get(getattr(hf, "model_type", None) or "llama",
                                                                       f"model_type {hf.model_type!r}")]
        arch = SUPPORTED_ARCHITECTURES.get(archs[0])
        if arch is None:
            raise ValueError(f"architecture {archs[0]} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        act = getattr(hf, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported: the Llama-family MLP here is SwiGLU (silu)")
        positions = hf.max_position_embeddings
        window = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
        if window and window < positions:       # within the window, full attention is the model's own
            log.warning("%s attends within a sliding window of %d tokens, which is not implemented here: serving a "
                        "context of %d", name or archs[0], window, window)
            positions = window
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        rope_theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=rope_theta,
            max_position_embeddings=positions,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            rope_scaling=rope_scaling,
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf, "bos_token_id", None),
            name=name,
        )
