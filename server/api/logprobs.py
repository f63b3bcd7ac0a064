"""OpenAI's logprobs objects from the engine's TokenLogprob entries: chat's `content` list (token, logprob, bytes,
top_logprobs) or the completions endpoint's legacy columns (tokens, token_logprobs, top_logprobs, text_offset).

A token's `bytes` are its own bytes (a byte-level BPE token can be one byte of a multi-byte character: the bytes of a
message's tokens, joined, decode to its text). Its text is those bytes decoded, or, where they are not whole UTF-8
characters, `bytes:\\xf0\\x9f` as OpenAI's legacy completions write them: decoded alone every such token read U+FFFD, so
the completions `top_logprobs` dict, keyed by text, kept one of several alternatives (and the least likely one's
logprob). Without a tokenizer a token reads "token_id:<id>", as vLLM writes it.
"""
from __future__ import annotations

import codecs
import functools
import re

from strata.server.engine.logprobs import TokenLogprob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")      # SentencePiece's byte fallback pieces


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spells each byte as one printable character: printable Latin-1 bytes as themselves,
    the other 68 as chr(256), chr(257), ... in byte order. Maps that character back to its byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    alphabet, spelled_above = {}, 256
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(spelled_above)] = byte
            spelled_above += 1
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


@functools.lru_cache(maxsize=1 << 16)
def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for in the text. Its decode is exact unless it is part of a multi-byte character (it
    then reads U+FFFD): those are read from the vocabulary piece, byte-level BPE's alphabet or SentencePiece's <0xNN>."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if byte := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(byte.group(1), 16)])
        if piece and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
    return text.encode()


def bytes_text(data: bytes) -> str:
    """Bytes as a token's text: decoded where they are whole UTF-8 characters, else OpenAI's `bytes:\\xNN...`."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class LogprobsFormat:
    """One request's formatter: a stream calls it once per chunk, and the completions `text_offset` runs on across
    the calls (so each chunk's offsets point into the whole text)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer = tokenizer
        self.chat = chat
        self.offset = 0     # characters of the choice's text before the next token (an echoed prompt's come first)
        self._characters = codecs.getincrementaldecoder("utf-8")(errors="replace")   # bytes of a character split
        # over tokens count once, when it is whole: an offset is where its token's character starts

    def token(self, token_id: int) -> tuple[str, bytes]:
        if self.tokenizer is None:
            text = f"token_id:{token_id}"
            return text, text.encode()
        data = token_bytes(self.tokenizer, token_id)
        return bytes_text(data), data

    def __call__(self, entries: list[TokenLogprob]) -> dict:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries: list[TokenLogprob]) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            text, data = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(data)}

        return {"content": [one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}

    def _completion(self, entries: list[TokenLogprob]) -> dict:
        tokens, offsets = [], []
        for e in entries:
            text, data = self.token(e.token_id)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(self._characters.decode(data))
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.logprob is None else self._alternatives(e) for e in entries],
                "text_offset": offsets}

    def _alternatives(self, entry: TokenLogprob) -> dict[str, float]:
        """The legacy dict of alternatives, most likely first (the engine's top-k order); should two tokens read
        alike, the likelier is kept."""
        alternatives: dict[str, float] = {}
        for token_id, logprob in entry.top:
            alternatives.setdefault(self.token(token_id)[0], logprob)
        return alternatives
