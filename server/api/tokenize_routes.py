"""vLLM's /tokenize and /detokenize: the token ids a prompt or a chat costs on this server (the very ids a
completion would be given, so benchmark tools can size prompts to the context), and the text of token ids."""
from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import Field, StrictInt

from strata.server.api.auth import Auth
from strata.server.api.body import parse_body
from strata.server.api.errors import APIError
from strata.server.api.prompts import PromptTooLong
from strata.server.api.protocol import ChatMessage, Strict, openapi_body, plain_messages
from strata.server.api.serving import Completer


class TokenizeRequest(Strict):
    """Either a prompt (tokenized as /v1/completions does) or chat messages (the chat template applied, with the
    assistant's turn opened, as /v1/chat/completions does)."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)


class DetokenizeRequest(Strict):
    model: str
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


def tokenize_router(auth: Auth, completer: Completer, max_body_bytes: int) -> APIRouter:
    router = APIRouter()
    info = completer.info

    @router.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(request: Request):
        auth.tenant(request)
        req = await parse_body(request, TokenizeRequest, max_body_bytes)
        completer.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt", code="invalid_value")
        chat = req.messages is not None
        messages = plain_messages(req.messages) if chat else [{"role": "user", "content": req.prompt}]
        try:
            ids = await completer.prompts.tokens(chat, tuple((m["role"], m["content"]) for m in messages))
        except PromptTooLong as exc:
            raise APIError(400, str(exc), param="messages" if chat else "prompt",
                           code="context_length_exceeded") from None
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": list(ids)}

    @router.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request):
        auth.tenant(request)
        req = await parse_body(request, DetokenizeRequest, max_body_bytes)
        completer.check_model(req.model)
        tokenizer = completer.inputs.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if any(t >= info.vocab_size for t in req.tokens):
            raise APIError(400, f"tokens must be in [0, {info.vocab_size}) for this model", param="tokens",
                           code="invalid_value")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens)}    # a long list: off the loop

    return router
