"""The one engine configuration object: every CLI flag and server option that shapes the engine lands here."""

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.cache.kv.storage import KV_DTYPES
from strata.kernels import fastest_cpu_weights
from strata.kernels.backend import BACKENDS
from strata.models.default_model import ensure_default_model
from strata.models.loader import LOAD_FORMATS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PREEMPTION_MODES = ("swap", "recompute")
SPECULATIVE = ("off", "ngram", "cache", "ngram+cache")
SPECULATIVE_POLICIES = ("cost", "always")
QUANTIZATIONS = ("auto", "none", "f16", "bf16", "int8", "int4", "gguf")
MAX_NUM_SEQS = 4096     # CUDA graphs and per-step buffers are sized by it: 10^8 would try to allocate them
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


@dataclass(slots=True)
class EngineConfig:
    """Engine settings. 'auto' values are resolved against the device at start (see `resolve_*`)."""

    model: str | None = None  # local Hugging Face model folder; none = the default model (converted on first use)
    load_format: str = "auto"  # auto (safetensors in the folder) or dummy (random weights of --model-config)
    model_config: str | None = None  # named model shape for dummy weights (e.g. Llama-3.2-1B)
    tokenizer: str | None = None  # tokenizer folder; none = the model's (dummy weights: the default model's)
    dtype: str = "auto"  # weights and activations: auto (bf16 on CUDA; on CPUs with AVX512_BF16 bf16 weights and dot products with fp32 activations, else fp32 math over fp16 weights) | fp32 | bf16 | fp16
    quantization: str = "auto"  # weights kept compact (CPU): auto (what --dtype picks) | none | f16 | bf16 (bf16 dot products) | int8 (Q8_0) | int4 (Q4_1; lm_head Q8_0) | gguf (the folder's .gguf blocks as stored)
    kv_dtype: str = "auto"  # KV cache: auto (= dtype) | fp32 | bf16 | fp16 | int8 (a scale per token and KV head)
    block_size: int = 16  # tokens per KV block (8, 16, 32, 64 or 128)
    kv_cache_memory: str = "auto"  # KV pool: bytes ("2GiB") or a fraction of free memory ("0.5"); auto: a quarter of free host memory up to 4 GiB on CPU, 90% of free GPU memory on CUDA
    max_num_seqs: int = 64  # most sequences in one step
    max_num_batched_tokens: int = 2048  # most tokens in one step (prefill chunks + decodes)
    prefill_beside_decodes: int | None = None  # most prompt tokens a step prefills while other requests decode in it (their inter-token time is that step's); none = auto: 256 on CPU, max_num_batched_tokens on CUDA
    max_model_len: int | None = None  # context length; none = the model's own
    swap_space: float = 0.0  # GiB of host memory for swapped-out KV blocks; 0 = no swapping
    preemption_mode: str = "recompute"  # when blocks run out: recompute (prefill again) or swap (needs --swap-space)
    enable_prefix_caching: bool = True  # reuse KV blocks of identical prompt prefixes across requests
    attention_backend: str = "auto"  # auto | cpu (C++ decode kernel) | torch | triton | triton-interpret
    enforce_eager: bool = False  # no CUDA graphs for decode (they are captured only on CUDA with Triton)
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N
    num_threads: int | None = None  # torch threads in the engine process; none = torch's default
    engine_nice: int = 10  # Linux nice of the engine process's threads (0-19): above the HTTP process's, so cache hits stay fast while steps run; 0 to compete at equal priority with other CPU-heavy work on the machine
    dummy_weights_seed: int = 0  # seed of the random weights of --load-format dummy
    speculative: str = "off"  # draft sources verified in one step: off | ngram (prompt lookup) | cache (answers of close cached questions) | ngram+cache
    num_speculative_tokens: int = 5  # most draft tokens per verify step (fewer while a request's drafts keep failing)
    speculative_max_step_tokens: int = 32  # drafts fill a step only up to this many tokens in all: past it a CPU step is compute-bound and a rejected draft costs more than it saves (raise it on a GPU)
    speculative_policy: str = "cost"  # cost: verify only draft tokens whose acceptance pays for their row, priced from the engine's own step times | always: every draft the step's budget allows

    def __post_init__(self) -> None:
        for name, choices in (("dtype", ("auto", *DTYPES)), ("kv_dtype", ("auto", *KV_DTYPES)),
                              ("load_format", LOAD_FORMATS), ("attention_backend", BACKENDS),
                              ("quantization", QUANTIZATIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(choices)}")
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"unknown device {self.device!r}; choose auto, cpu, cuda or cuda:N")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if not 0 < self.max_num_seqs <= MAX_NUM_SEQS or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"need 0 < max_num_seqs <= {MAX_NUM_SEQS} and max_num_batched_tokens >= max_num_seqs")
        if self.prefill_beside_decodes is not None and self.prefill_beside_decodes < 1:
            raise ValueError(f"prefill_beside_decodes must be >= 1 token, got {self.prefill_beside_decodes}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}")
        if self.preemption_mode == "swap" and not self.swap_space:
            raise ValueError("preemption_mode swap needs --swap-space (GiB of host memory to swap blocks to); "
                             "without it sequences are recomputed")
        if self.load_format != "dummy" and self.model_config is not None:
            raise ValueError(f"--model-config {self.model_config} names a shape for --load-format dummy; real weights "
                             "take theirs from the model folder's config.json")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE)}, got {self.speculative!r}")
        if self.speculative_policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"speculative_policy must be one of {', '.join(SPECULATIVE_POLICIES)}, "
                             f"got {self.speculative_policy!r}")
        if self.num_speculative_tokens < 1 or self.speculative_max_step_tokens < 1:
            raise ValueError("num_speculative_tokens and speculative_max_step_tokens must be >= 1")
        if not 0 <= self.swap_space < float("inf"):
            raise ValueError(f"swap_space must be a finite number of GiB >= 0, got {self.swap_space}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 token, got {self.max_model_len}")
        most_threads = 8 * (os.cpu_count() or 1)       # 100,000 OpenMP threads segfaulted
        if self.num_threads is not None and not 0 <= self.num_threads <= most_threads:
            raise ValueError(f"num_threads must be in 1..{most_threads} here (0 or none: torch's default), "
                             f"got {self.num_threads}")
        if not 0 <= self.engine_nice <= 19:
            raise ValueError(f"engine_nice must be in 0..19 (Linux nice), got {self.engine_nice}")
        parse_memory(self.kv_cache_memory)  # fail early on a malformed size

    def resolve_model_path(self) -> Path | None:
        """The weights folder: --model, else the default model (converted on first use); None for dummy weights."""
        if self.load_format == "dummy":
            return None
        return Path(self.model) if self.model else ensure_default_model()

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: this torch has no CUDA device to use (a CPU build, or no GPU)")
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        """bf16 on CUDA; on CPU what kernels.fastest_cpu_weights picks."""
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else fastest_cpu_weights().dtype
        return DTYPES[self.dtype]

    def resolve_weight_format(self, device: torch.device) -> tuple[str, str]:
        """(how linear weights are stored, why): explicit --quantization, else what --dtype auto picks for this CPU."""
        if self.quantization == "auto":
            if self.dtype == "auto" and device.type == "cpu":
                choice = fastest_cpu_weights()
                return choice.weight_format, f"--dtype auto on {choice.reason}"
            return "none", f"dense {self.dtype} weights"
        if self.quantization != "none" and device.type != "cpu":
            raise ValueError(f"--quantization {self.quantization} runs on CPU only: on CUDA the Triton Q8_0 / Q4 "
                             "engine path has not yet passed its GPU tests; use --dtype bf16")
        return self.quantization, f"--quantization {self.quantization}"

    def resolve_prefill_beside_decodes(self, device: torch.device) -> int:
        """A CPU prefills ~250 tokens a second per core on the default model: a 2,048-token chunk held every request
        decoding beside it for 4 s a token, 256 for 0.7 s, at the same time to first token for the long prompt."""
        if self.prefill_beside_decodes is not None:
            return min(self.prefill_beside_decodes, self.max_num_batched_tokens)
        return self.max_num_batched_tokens if device.type == "cuda" else min(256, self.max_num_batched_tokens)

    def resolve_kv_dtype(self, dtype: torch.dtype) -> str:
        if self.kv_dtype == "auto":
            return {v: k for k, v in DTYPES.items()}[dtype]
        return self.kv_dtype


def parse_memory(value: str | int | float) -> tuple[str, float]:
    """'auto' | a fraction in (0, 1] of free memory | a byte count with optional unit -> (kind, amount)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    text = str(value).strip().lower()
    if text == "auto":
        return "auto", 0.0
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)", text)
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"cannot read KV cache memory {value!r}: use bytes like '2GiB' or a fraction like '0.5'")
    number = float(match.group(1))
    if not match.group(2) and number <= 1.0:
        if number <= 0:
            raise ValueError("KV cache memory fraction must be > 0")
        return "fraction", number
    return "bytes", number * _UNITS[match.group(2)]


def free_memory_bytes(device: torch.device) -> int:
    """Free memory where the KV pool will live: the GPU's, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def kv_cache_bytes(setting: str, device: torch.device) -> int:
    """Bytes for the KV pool: auto = 90% of free GPU memory, or a quarter of free host memory up to 4 GiB."""
    kind, amount = parse_memory(setting)
    free = free_memory_bytes(device)
    if kind == "auto":
        return int(free * 0.9) if device.type == "cuda" else int(min(free * 0.25, 4 * 2**30))
    if kind == "fraction":
        return int(free * amount)
    if amount > free:       # the allocator's own error names no flag, and a size just under free invites the OOM killer
        raise ValueError(f"--kv-cache-memory {setting} is more than the {free / 2**30:.1f} GiB free on {device.type}")
    return int(amount)
