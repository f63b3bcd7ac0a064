"""Speculative decoding: draft sources and the rule that verifies their tokens in one step."""
