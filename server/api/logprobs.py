"""OpenAI's logprobs objects from the engine's TokenLogprob entries: chat's `content` list (token, logprob, bytes,
top_logprobs) or the completions endpoint's legacy columns (tokens, token_logprobs, top_logprobs, text_offset).

A token's text is its own decode (a byte-level token that is part of a multi-byte character reads as U+FFFD, as the
tokenizer decodes it alone); `bytes` are that text's UTF-8. Without a tokenizer a token reads "token_id:<id>", as
vLLM writes it.
"""
from __future__ import annotations

from strata.server.engine.logprobs import TokenLogprob


class LogprobsFormat:
    """One request's formatter: a stream calls it once per chunk, and the completions `text_offset` runs on across
    the calls (so each chunk's offsets point into the whole text)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer = tokenizer
        self.chat = chat
        self.offset = 0     # of the next token in the choice's text (an echoed prompt's tokens come first)

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def __call__(self, entries: list[TokenLogprob]) -> dict:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries: list[TokenLogprob]) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}

    def _completion(self, entries: list[TokenLogprob]) -> dict:
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.logprob is None else {self.token_text(t): lp for t, lp in e.top}
                                 for e in entries],
                "text_offset": offsets}
