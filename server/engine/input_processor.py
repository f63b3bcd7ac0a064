"""InputProcessor: tokenize a prompt and check it against the loaded model's limits, without the model.

Why apart from LLMEngine: the HTTP server validates every request before any output, but it must not hold weights,
a KV pool or a CUDA context; those live in the engine process (server/engine/engine_process.py). Validation needs only the
tokenizer and the few numbers in ModelInfo, which the engine process reports when it has loaded. LLMEngine checks
its own requests with the same class, so both processes refuse the same input with the same message.
"""

import functools
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.models.default_model import default_model_dir
from strata.server.engine.config import EngineConfig
from strata.server.engine.sampling_params import SamplingParams
from strata.server.engine.sequence import Sequence


class RequestError(ValueError):
    """A request the engine refuses; the message says why (the HTTP layer maps it to a 400)."""


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What the loaded engine knows that requests are checked (and cache keys built) against; picklable."""

    model_id: str
    model_path: Path | None       # None: dummy weights
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int       # tokens the KV pool holds: a longer prompt could never be scheduled
    fingerprint: str              # weights, dtype and KV dtype (fingerprint.model_fingerprint)

    def serves_like(self, other: "ModelInfo") -> bool:
        """Same model, vocabulary and fingerprint: a restarted engine may take over. Not the context: a KV pool sized
        from the memory free at the start may hold fewer or more tokens than the last one did (requests are then
        checked against the new length)."""
        return (self.model_id, self.vocab_size, self.fingerprint) == (other.model_id, other.vocab_size,
                                                                      other.fingerprint)

    @property
    def model_key(self) -> str:
        """Model id + version: the request cache's partition, so other weights or formats never share answers."""
        return f"{self.model_id}@{self.fingerprint}"


def load_tokenizer(config: EngineConfig, model_path: Path | None):
    """The tokenizer of --tokenizer, else the model folder's; None for a folder without one (tiny test checkpoints
    run on token ids). Dummy weights borrow the default model's tokenizer when it is converted already."""
    from transformers import AutoTokenizer

    if config.tokenizer:
        if not Path(config.tokenizer).is_dir():      # Strata never downloads: a name is not a Hub repository here
            raise FileNotFoundError(f"--tokenizer {config.tokenizer} is not a folder")
        return AutoTokenizer.from_pretrained(config.tokenizer)
    source = model_path or default_model_dir()
    has_tokenizer = (source / "tokenizer.json").exists() or (source / "tokenizer_config.json").exists()
    return AutoTokenizer.from_pretrained(source) if has_tokenizer else None


class InputProcessor:
    """Turns a prompt (text, chat turns or token ids) into a validated Sequence; safe from any thread."""

    def __init__(self, info: ModelInfo, tokenizer):
        self.info = info
        self.tokenizer = tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt; with chat=True, the user message wrapped in the model's chat template."""
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: pass token ids")
        if chat:
            return self.apply_chat_template([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """The turns in the model's chat template. A message's text is only text: "<|im_end|>" written in a message
        stays those characters, so a user cannot close their turn and open a system one."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise RequestError("this model has no tokenizer: pass token ids")
        if not any(marker in m["content"] for m in messages for marker in self._control_tokens):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        # Render with a placeholder per message, then tokenize the template's parts (control tokens parsed) and the
        # messages' texts (control tokens split into plain characters) apart.
        holders = [f"\ue000{i}\ue001" for i in range(len(messages))]
        rendered = tokenizer.apply_chat_template([m | {"content": h} for m, h in zip(messages, holders, strict=True)],
                                                 add_generation_prompt=True, tokenize=False)
        if any(rendered.count(h) != 1 for h in holders):
            raise RequestError("a message holds the model's control tokens as text, and its chat template does not "
                               "keep each message whole: remove them")
        ids: list[int] = []
        for message, holder in zip(messages, holders, strict=True):
            template, _, rendered = rendered.partition(holder)
            ids += tokenizer.encode(template, add_special_tokens=False)
            ids += tokenizer.encode(message["content"], add_special_tokens=False, split_special_tokens=True)
        return ids + tokenizer.encode(rendered, add_special_tokens=False)

    @functools.cached_property
    def _control_tokens(self) -> tuple[str, ...]:
        """The texts the tokenizer turns into its special tokens (<|im_start|>, <|im_end|>, ...)."""
        return tuple(t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special)

    def make_sequence(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                      chat: bool = False) -> Sequence:
        """Validate and tokenize a request; raises RequestError on input the engine could never serve (InvalidParam
        for a stop token id outside the vocabulary)."""
        if isinstance(prompt, str) and not prompt.strip() or isinstance(prompt, list) and not prompt:
            raise RequestError("prompt is empty")
        token_ids = self.encode(prompt, chat)
        info = self.info
        if any(not isinstance(t, int) or not 0 <= t < info.vocab_size for t in token_ids):
            raise RequestError(f"prompt token ids must be integers in [0, {info.vocab_size})")
        params.check_vocab(info.vocab_size)
        if len(token_ids) >= info.max_model_len:
            held = " (all --kv-cache-memory holds)" if info.max_model_len >= info.kv_capacity_tokens else ""
            raise RequestError(f"prompt has {len(token_ids)} tokens; this model's context is {info.max_model_len}{held}")
        if len(token_ids) + 1 > info.kv_capacity_tokens:     # the prompt and one new token, in whole blocks
            raise RequestError(f"prompt has {len(token_ids)} tokens but the KV cache holds only "
                               f"{info.kv_capacity_tokens}; raise --kv-cache-memory")
        return Sequence(request_id or f"req-{next(self._ids)}", list(token_ids), params)
