"""Prompt text -> token ids for the HTTP process: memoised for repeated questions (the cache-hit case), bounded in
bytes, never holding a prompt the server refused, and off the event loop when the text is long."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from cachetools import LRUCache

from strata.server.engine.input_processor import InputProcessor

INLINE_CHARS = 2_000          # shorter texts tokenize in well under a millisecond: a worker-thread hop would cost more


@dataclass(frozen=True, slots=True)
class _Tokens:
    ids: tuple[int, ...]
    nbytes: int


class PromptTooLong(ValueError):
    """More characters than the context could hold even at the longest token: refused without tokenizing."""


class PromptTokens:
    """`await tokens(chat, turns)` tokenizes; `remember(...)` keeps the result once the request was accepted."""

    def __init__(self, inputs: InputProcessor, max_bytes: int = 32 * 2**20):
        self.inputs = inputs
        self.memo: LRUCache = LRUCache(maxsize=max_bytes, getsizeof=lambda t: t.nbytes)
        tokenizer = inputs.tokenizer
        longest = max(map(len, tokenizer.get_vocab())) if tokenizer is not None else 1
        self.max_chars = inputs.info.max_model_len * max(longest, 1)

    async def tokens(self, chat: bool, turns: tuple[tuple[str, str], ...]) -> tuple[int, ...]:
        """Token ids of a chat (template applied) or of a plain prompt (turns[0]); PromptTooLong, or the
        InputProcessor's ValueError, for text it cannot take."""
        known = self.memo.get((chat, turns))
        if known is not None:
            return known.ids
        chars = sum(len(text) for _, text in turns)
        if chars > self.max_chars:
            raise PromptTooLong(f"the prompt has {chars} characters, more than this model's context of "
                                f"{self.inputs.info.max_model_len} tokens can hold")
        if chars <= INLINE_CHARS:
            return self._tokenize(chat, turns)
        return await asyncio.to_thread(self._tokenize, chat, turns)

    def remember(self, chat: bool, turns: tuple[tuple[str, str], ...], ids: tuple[int, ...]) -> None:
        """Keep an accepted prompt's ids (a refused one is never kept: it would only hold memory)."""
        nbytes = 64 + 2 * sum(len(text) for _, text in turns) + 8 * len(ids)
        if nbytes <= self.memo.maxsize:
            self.memo[(chat, turns)] = _Tokens(ids, nbytes)

    def _tokenize(self, chat: bool, turns: tuple[tuple[str, str], ...]) -> tuple[int, ...]:
        if chat:
            return tuple(self.inputs.apply_chat_template([{"role": r, "content": c} for r, c in turns]))
        return tuple(self.inputs.encode(turns[0][1]))
