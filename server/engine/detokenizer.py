"""Incremental detokenization: new text per step from a small window, holding back half-finished characters."""

from strata.server.engine.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.offsets: dict[str, tuple[int, int]] = {}  # request_id -> (prefix_offset, read_offset)

    def update(self, seq: Sequence) -> str:
        """Append the text of seq's newest tokens to seq.output_text and return it."""
        prefix, read = self.offsets.get(seq.request_id, (seq.num_prompt_tokens, seq.num_prompt_tokens))
        ids = seq.token_ids
        skip = seq.params.skip_special_tokens
        prefix_text = self.tokenizer.decode(ids[prefix:read], skip_special_tokens=skip)
        full_text = self.tokenizer.decode(ids[prefix:], skip_special_tokens=skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        new_text = full_text[len(prefix_text):]
        self.offsets[seq.request_id] = (read, len(ids))
        seq.output_text += new_text
        return new_text

    def forget(self, request_id: str) -> None:
        self.offsets.pop(request_id, None)
