"""The request path both endpoints share: validate against the model, ask the request cache, else stream from
the engine and hand the finished text back to the cache (write-back happens off the response path)."""
from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from strata.cache.request.request_cache import AnswerMeta, CacheRequest, Lookup, RequestCache
from strata.server.api.config import ServerConfig
from strata.server.api.errors import APIError
from strata.server.api.prompts import INLINE_CHARS, PromptTokens, PromptTooLong
from strata.server.api.protocol import ChatCompletionRequest, CompletionRequest, usage
from strata.server.engine.engine_client import EngineClient, EngineRequestFailed, EngineUnavailable
from strata.server.engine.input_processor import RequestError
from strata.server.engine.logprobs import TokenLogprob
from strata.server.engine.sampling_params import InvalidParam, SamplingParams
from strata.server.engine.sequence import Sequence

CACHE_DRAFTS = 2        # with --speculative cache: the answers of this many closest unserved questions go as drafts
SIMILAR_NOTE = "[Note: this answers a similar earlier question (similarity {:.2f}), not necessarily yours.]\n\n"


def cache_sampling(temperature: float, top_p: float = 1.0, max_tokens: int | None = None, stop=None,
                   seed: int | None = None, endpoint: str | None = None) -> dict:
    """Sampling as the cache keys it: defaults left out, so a warm-up entry matches a plain request."""
    out = {"temperature": temperature, "top_p": top_p if top_p != 1.0 else None, "max_tokens": max_tokens,
           "stop": stop or None, "seed": seed, "endpoint": endpoint}
    return {k: v for k, v in out.items() if v is not None}


@dataclass(slots=True)
class Answer:
    """Where one response comes from, and its text as pieces; counters fill in while the pieces are read."""

    layer: str                          # exact | semantic | semantic-similar | miss | bypass
    reason: str
    similarity: float | None
    prompt_tokens: int
    pieces: AsyncIterator[str] | None = None   # engine output as it comes (None for a cache hit)
    cached_text: str | None = None             # a cache hit's whole answer, sent in one write
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    started: float = 0.0                # perf_counter at arrival
    ttft_s: float | None = None
    lookup: Lookup | None = None        # a miss's cache lookup: completed, failed, or released when given up
    logprobs: list[TokenLogprob] | None = None   # per token (echoed prompt's first), when asked (None: not asked)
    echo: str | None = None             # the prompt's text, streamed before the answer (completions' echo)
    scores_only: bool = False           # max_tokens 0 with echo: the token the engine sampled is not returned
    sent_logprobs: int = 0              # of logprobs, handed out by take_logprobs already
    prefilled: asyncio.Event = field(default_factory=asyncio.Event)   # set at its first output (or its end)
    spec: dict[str, dict[str, int]] | None = None   # what speculative drafts did for it, per source
    repeats_prompt: bool = False        # a later sample (n > 1) of its prompt: usage counts the prompt once

    def release(self) -> None:
        """Let single-flight followers go if this answer was never computed (a client gone before its first byte);
        a no-op once the answer completed or failed. Routes call it when they are done with the answer."""
        if self.lookup is not None:
            self.lookup.release()

    def headers(self) -> dict[str, str]:
        out = {"X-Strata-Cache": self.layer}
        if self.similarity is not None and self.layer.startswith("semantic"):
            out["X-Strata-Similarity"] = f"{self.similarity:.4f}"
        if self.spec:   # known once the answer is done: a non-streamed response's headers (and every body) carry it
            out["X-Strata-Spec"] = "; ".join(f"{source} " + " ".join(f"{k}={v}" for k, v in counts.items())
                                             for source, counts in self.spec.items())
        return out

    def strata(self) -> dict:
        out = {"cache": self.layer, "similarity": self.similarity, "reason": self.reason}
        return out | {"spec": self.spec} if self.spec else out

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def take_logprobs(self) -> list[TokenLogprob]:
        """The logprobs not handed out yet: a stream sends each token's with the chunk that carries its text."""
        fresh = self.logprobs[self.sent_logprobs:]
        self.sent_logprobs = len(self.logprobs)
        return fresh

    def mark_first(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.started


class Completer:
    """Turns one validated request into an Answer: cache hit replayed, or engine output streamed."""

    def __init__(self, engine: EngineClient, cache: RequestCache | None, config: ServerConfig):
        """engine: a ready engine process; its InputProcessor validates and tokenizes here."""
        self.engine = engine
        self.inputs = engine.inputs
        self.info = engine.inputs.info
        self.cache = cache
        self.config = config
        self.model_key = self.info.model_key
        self.prompts = PromptTokens(engine.inputs)
        self.cache_drafts = CACHE_DRAFTS if "cache" in engine.config.speculative.split("+") else 0
        # Misses admitted and not finished. The engine registers a stream only once its response is read, so requests
        # arriving together all saw an empty queue: --max-queue counts from admission.
        self.admitted = 0

    async def answer(self, req: ChatCompletionRequest | CompletionRequest, tenant: str, cache_control: str,
                     client_id: str | None, started: float, prompt: str | list[int] | None = None,
                     leader: Answer | None = None, sample: int = 0, origin: str | None = None) -> Answer:
        """started: when the request arrived (perf_counter), so latency and TTFT include parsing and lookup.
        prompt: the completions prompt this answer is for (text or token ids; a request may carry several).
        sample, leader: with n > 1, this answer is sample `sample` of its prompt; it starts once the prompt's first
        sample (the leader) has been prefilled, so that it reuses the prompt's KV blocks from the prefix cache.
        origin: the request's id when it carries several prompts, so that none waits on another's computation."""
        chat = isinstance(req, ChatCompletionRequest)
        self.check_model(req.model)
        prompt_param = "messages" if chat else "prompt"
        messages = None
        try:
            if isinstance(prompt, list):
                ids = self.checked_ids(prompt)
            else:
                messages = req.plain_messages() if chat else [{"role": "user", "content": prompt}]
                turns = tuple((m["role"], m["content"]) for m in messages)
                ids = await self.prompts.tokens(chat, turns)
        except PromptTooLong as exc:
            raise APIError(400, str(exc), param=prompt_param, code="context_length_exceeded") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=prompt_param, code="invalid_value") from None
        params = self._params(req, len(ids), prompt_param, sample)
        if messages is not None:
            self.prompts.remember(chat, turns, ids)
        echo = not chat and bool(req.echo)
        # echo and logprobs answers carry the prompt and per-token data the response cache does not store: such a
        # request neither reads nor writes it; a token-id prompt has no text to key (or embed) by
        # n > 1 asks for samples that differ; the cache holds one answer per question
        bypass = "echo" if echo else "logprobs" if params.logprobs is not None else "n>1" if req.n > 1 \
            else "token-ids" if messages is None else None
        lookup = None if bypass else await self._lookup(req, tenant, messages, cache_control, client_id, chat, origin,
                                                        params.max_tokens)
        if lookup is not None and lookup.hit is not None:
            return await self._replay(req, lookup, len(ids), started)
        if lookup is not None and lookup.error is not None:
            raise shared_failure(lookup.error)
        answer = Answer(lookup.layer if lookup else "bypass",
                        lookup.reason if lookup else bypass or "no-cache-configured", None, len(ids),
                        started=started, lookup=lookup, logprobs=[] if params.logprobs is not None else None,
                        echo=self.echo_text(prompt, ids) if echo else None,
                        scores_only=req.requested_max_tokens() == 0, repeats_prompt=sample > 0)
        queued = max(self.engine.num_pending, self.admitted)
        if queued >= self.config.max_queue:
            if lookup is not None:
                lookup.release()
            raise APIError(503, f"server overloaded: {queued} requests queued; retry shortly", code="overloaded",
                           headers={"Retry-After": "1"})
        done = self._admit()
        try:
            try:
                self.engine.check_available()      # before any stream is promised: a 503 now, not an in-band error
            except EngineUnavailable as exc:
                raise unavailable(exc) from None
            seq = self.inputs.make_sequence(list(ids), params)
            if lookup is not None and lookup.drafts:
                seq.draft_candidates = [await self.tokens_of(text) for text in lookup.drafts]
        except BaseException as exc:
            done()
            if lookup is not None:
                lookup.release()        # followers compute themselves; nothing computed, nothing to remember
            if not isinstance(exc, (APIError, RequestError, InvalidParam)):
                raise
            raise exc if isinstance(exc, APIError) else bad_param(exc, prompt_param) from None
        answer.pieces = self._generate(seq, lookup, tuple(req.cache_tags), answer, leader, done)
        weakref.finalize(answer.pieces, done)       # a response never read (client gone first) ends here
        return answer

    def _admit(self) -> Callable[[], None]:
        """Count one admitted miss; the returned callable uncounts it, once however often it is called."""
        self.admitted += 1
        state = {"counted": True}

        def done() -> None:
            if state["counted"]:
                state["counted"] = False
                self.admitted -= 1
        return done

    def check_model(self, model: str) -> None:
        """404 for a model this server does not serve."""
        if model != self.info.model_id:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.info.model_id}'",
                           param="model", code="model_not_found")

    def echo_text(self, prompt: str | list[int], ids: tuple[int, ...]) -> str:
        """The prompt as echoed: its text, or a token-id prompt decoded."""
        if isinstance(prompt, str):
            return prompt
        tokenizer = self.inputs.tokenizer
        return tokenizer.decode(list(ids)) if tokenizer is not None else ""

    def checked_ids(self, ids: list[int]) -> tuple[int, ...]:
        """A token-id prompt, each id in the vocabulary (they index the embedding table)."""
        vocab = self.info.vocab_size
        if any(t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}) for this model")
        return tuple(ids)

    async def count_tokens(self, text: str) -> int:
        """Tokens of a text (an answer stored without its count, a note): long texts in a worker thread."""
        if len(text) <= INLINE_CHARS:
            return self._count_tokens(text)
        return await asyncio.to_thread(self._count_tokens, text)

    def _count_tokens(self, text: str) -> int:
        return len(self._tokens_of(text))

    async def tokens_of(self, text: str) -> list[int]:
        """A text's token ids (an answer used as a draft): long texts in a worker thread."""
        if len(text) <= INLINE_CHARS:
            return self._tokens_of(text)
        return await asyncio.to_thread(self._tokens_of, text)

    def _tokens_of(self, text: str) -> list[int]:
        tokenizer = self.inputs.tokenizer
        return tokenizer.encode(text, add_special_tokens=False) if tokenizer else []

    def _params(self, req, prompt_tokens: int, prompt_param: str, sample: int = 0) -> SamplingParams:
        """sample: which of the n samples; with a seed, sample j > 0 draws from seed + j (modulo 2**64), so the
        samples differ and each is reproducible."""
        limit = self.info.max_model_len
        room = limit - prompt_tokens
        requested = req.requested_max_tokens()
        if room < 1 or requested is not None and requested <= limit and requested > room:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt_tokens + (requested or 1)} tokens ({prompt_tokens} in the {prompt_param}, "
                                f"{requested or 1} in the completion).", param=prompt_param,
                           code="context_length_exceeded")
        if requested == 0 and not (isinstance(req, CompletionRequest) and req.echo):
            raise APIError(400, "max_tokens 0 is only for scoring a prompt (with echo: true)", param="max_tokens",
                           code="invalid_value")
        if requested is not None and requested > limit:
            raise APIError(400, f"max_tokens is too large: {requested}. This model supports at most {limit} "
                                f"completion tokens.", param=req.max_tokens_param(), code="invalid_value")
        try:
            return SamplingParams(
                temperature=req.temperature, top_p=req.top_p, stop=req.stop or [],
                seed=req.seed if req.seed is None or sample == 0 else (req.seed + sample) % 2**64,
                # max_tokens 0: the prefill samples one token anyway (not returned), so asking for it costs nothing
                max_tokens=1 if requested == 0 else requested or min(self.config.default_max_tokens, room),
                min_tokens=req.min_tokens,
                ignore_eos=req.ignore_eos, stop_token_ids=list(req.stop_token_ids),
                repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output, logprobs=req.requested_logprobs(),
                prompt_logprobs=req.requested_prompt_logprobs() if isinstance(req, CompletionRequest) else None)
        except InvalidParam as exc:
            raise bad_param(exc) from None

    async def _lookup(self, req, tenant: str, messages: list[dict], cache_control: str, client_id: str | None,
                      chat: bool, origin: str | None, max_tokens: int) -> Lookup | None:
        """max_tokens: the limit the answer is generated under (the request's, else the server's default or the room
        the prompt leaves), so answers cut at another limit are never served for this one."""
        if self.cache is None:
            return None
        directives = {d.strip().lower() for d in cache_control.split(",")}
        sampling = cache_sampling(req.temperature, req.top_p, max_tokens, req.stop, req.seed,
                                  None if chat else "completions") | req.answer_extensions()
        try:
            creq = CacheRequest(tenant, self.model_key, messages, sampling, mode=req.cache,
                                no_cache="no-cache" in directives, no_store="no-store" in directives,
                                client_id=client_id, draft_answers=self.cache_drafts,
                                origin=origin, verbatim=not chat)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return await self.cache.lookup(creq)

    async def _replay(self, req, lookup: Lookup, prompt_tokens: int, started: float) -> Answer:
        """A cached answer as it was first served: its finish reason ("length" stays "length") and token count come
        from the stored metadata; entries without it (older files, warm-up) say "stop" and are counted here."""
        hit = lookup.hit
        text = hit.text
        meta = hit.meta
        tokens = meta.completion_tokens if meta is not None and meta.completion_tokens is not None else None
        if tokens is None:
            tokens = await self.count_tokens(text)
        similar = "semantic-similar" in (hit.layer, hit.source)
        if similar and (self.config.similar_note if req.similar_note is None else req.similar_note):
            note = SIMILAR_NOTE.format(hit.similarity)
            text, tokens = note + text, tokens + await self.count_tokens(note)
        answer = Answer(hit.layer, lookup.reason, hit.similarity, prompt_tokens, cached_text=text,
                        finish_reason=meta.finish_reason if meta is not None else "stop", completion_tokens=tokens,
                        started=started)
        answer.mark_first()
        return answer

    async def _generate(self, seq: Sequence, lookup: Lookup | None, tags: tuple[str, ...],
                        answer: Answer, leader: Answer | None, done: Callable[[], None]) -> AsyncIterator[str]:
        """Engine output as it comes; closing early aborts the sequence (blocks freed) and releases followers. `done`
        uncounts the admission when the output ends, however it ends."""
        text, echo = "", answer.echo
        try:
            if leader is not None:
                await leader.prefilled.wait()
            async with aclosing(self.engine.submit(seq)) as outputs:
                async for out in outputs:
                    answer.mark_first()
                    answer.prefilled.set()
                    answer.cached_tokens = out.num_cached_tokens
                    if answer.logprobs is not None and out.prompt_logprobs:
                        answer.logprobs += out.prompt_logprobs
                    if echo:                 # the prompt's text first, with its tokens' logprobs
                        yield echo
                        echo = None
                    if answer.scores_only:
                        answer.finish_reason = "length"
                        continue
                    answer.completion_tokens = len(out.token_ids)
                    answer.spec = out.spec
                    if out.finished:
                        answer.finish_reason, text = out.finish_reason, out.text
                    if answer.logprobs is not None:
                        answer.logprobs += out.new_logprobs
                    if out.new_text:
                        yield out.new_text
        except EngineUnavailable as exc:
            if lookup is not None:
                lookup.release()                # not this question's fault: followers try again themselves
            raise unavailable(exc) from None
        except EngineRequestFailed as exc:
            if lookup is not None:
                lookup.fail(exc)
            raise engine_failure(exc) from None
        except BaseException as exc:
            if lookup is not None:
                lookup.fail(exc)
            raise
        finally:
            done()
            answer.prefilled.set()          # later samples go on even when this one ended before its first output
        if lookup is not None:
            lookup.complete(text, tags=tags, meta=AnswerMeta(answer.finish_reason, answer.completion_tokens))


def bad_param(exc: ValueError, prompt_param: str | None = None) -> APIError:
    """Input the engine refuses (RequestError, InvalidParam), as a 400 naming the field when one is at fault: a
    RequestError from making the sequence is about the prompt (empty, too long for the KV cache)."""
    param = exc.param if isinstance(exc, InvalidParam) else prompt_param
    return APIError(400, str(exc), param=param, code="invalid_value" if param else None)


def engine_failure(exc: EngineRequestFailed) -> APIError:
    return APIError(500, f"the engine failed this request: {exc}", code="engine_error")


def shared_failure(exc: Exception) -> APIError:
    """The error of a computation this request waited on (single-flight) or repeated moments after (the negative
    cache), as its leader got it. A new APIError each time: one exception raised in many tasks grows its traceback."""
    if isinstance(exc, RequestError):
        return APIError(400, str(exc))
    if isinstance(exc, EngineRequestFailed):
        return engine_failure(exc)
    if isinstance(exc, APIError):
        return APIError(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers)
    return APIError(500, f"the identical request this one waited on failed ({type(exc).__name__})",
                    code="internal_error")


def unavailable(exc: EngineUnavailable) -> APIError:
    """503 with Retry-After while the engine restarts; without it when it will not come back."""
    headers = {"Retry-After": str(round(exc.retry_after_s))} if exc.retry_after_s is not None else None
    return APIError(503, str(exc), code="engine_unavailable", headers=headers)
