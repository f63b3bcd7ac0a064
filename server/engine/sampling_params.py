"""Per-request generation settings, validated on arrival so bad input never reaches the engine."""

import math
from dataclasses import dataclass, field

# Below this a temperature is greedy: fp32 logits divided by a smaller value overflow, and the result is argmax anyway.
MIN_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)       # what torch.Generator.manual_seed takes
PENALTY_RANGE = (-2.0, 2.0)              # presence and frequency penalties, as OpenAI bounds them
# repetition penalty: dividing a logit by 1e-38 overflows to inf and the answer became one special token repeated
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_STOPS = 16
MAX_STOP_TOKEN_IDS = 1024                # each one is checked against every token the sequence samples
MAX_LOGPROBS = 20                        # top alternatives per token, as OpenAI bounds top_logprobs


class InvalidParam(ValueError):
    """A setting the engine cannot honour; `param` names the field, so an HTTP 400 can name it too."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(slots=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 means off; a seed makes sampling reproducible per request. The rest follow
    vLLM: penalties of 1.0 / 0.0 are off, min_tokens holds EOS and stop_token_ids back until that many tokens."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None     # None: none; k: the sampled token's logprob and the k most likely (engine/logprobs.py)
    prompt_logprobs: int | None = None   # the same for each prompt token after the first (computed in prefill)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise InvalidParam(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not (_number(self.temperature) and self.temperature >= 0.0):
            raise InvalidParam(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not (_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidParam(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidParam(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}", "top_k")
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise InvalidParam(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}", "seed")
        if len(self.stop) > MAX_STOPS or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParam(f"stop takes at most {MAX_STOPS} non-empty strings", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or \
                any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise InvalidParam(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} token ids (integers >= 0)",
                               "stop_token_ids")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParam(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], got "
                               f"{self.min_tokens!r}", "min_tokens")
        low, high = REPETITION_PENALTY_RANGE
        if not (_number(self.repetition_penalty) and low <= self.repetition_penalty <= high):
            raise InvalidParam(f"repetition_penalty must be a number in [{low}, {high}], got "
                               f"{self.repetition_penalty!r}", "repetition_penalty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (type(value) is int and 0 <= value <= MAX_LOGPROBS):
                raise InvalidParam(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}", name)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_number(value) and PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]):
                raise InvalidParam(f"{name} must be in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]}], got {value!r}", name)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model's vocabulary (they index its logits)."""
        if any(t >= vocab_size for t in self.stop_token_ids):
            raise InvalidParam(f"stop_token_ids must be in [0, {vocab_size}) for this model", "stop_token_ids")

    @property
    def penalized(self) -> bool:
        """Any penalty on: the sampler then counts this sequence's tokens."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it that sampling would pick the argmax anyway."""
        return self.temperature < MIN_TEMPERATURE
