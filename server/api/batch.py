"""The answers of one request as a whole: one choice per prompt (completions may carry several) and sample (`n`),
in order. Their texts are awaited together, their pieces merged into one stream, their
usage summed (each prompt once); one that fails cancels the rest (whose sequences are aborted, their blocks freed)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from strata.server.api.protocol import usage
from strata.server.api.serving import Answer
from strata.server.engine.logprobs import TokenLogprob


async def text_of(answer: Answer) -> str:
    if answer.cached_text is not None:
        return answer.cached_text
    async with aclosing(answer.pieces) as pieces:
        return "".join([piece async for piece in pieces])


async def _all_cancelled_on_exit(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def texts(answers: list[Answer]) -> list[str]:
    """Every answer's whole text, computed concurrently (the engine batches them)."""
    tasks = [asyncio.ensure_future(text_of(a)) for a in answers]
    try:
        return await asyncio.gather(*tasks)
    finally:
        await _all_cancelled_on_exit(tasks)


async def merged(answers: list[Answer]) -> AsyncIterator[tuple[int, str, list[TokenLogprob]]]:
    """(choice index, text piece, logprobs of the piece's tokens) as any answer produces them."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, answer: Answer) -> None:
        try:
            if answer.cached_text is not None:
                await queue.put((index, answer.cached_text, []))
            else:
                async with aclosing(answer.pieces) as pieces:
                    async for piece in pieces:
                        await queue.put((index, piece, answer.take_logprobs() if answer.logprobs is not None else []))
            await queue.put(done)
        except Exception as exc:        # handed to the consumer, which raises it and cancels the others
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(i, a)) for i, a in enumerate(answers)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        await _all_cancelled_on_exit(tasks)


def total_usage(answers: list[Answer]) -> dict:
    """Each prompt counted once, as its first sample computed it (OpenAI's and vLLM's usage: n multiplies the
    completion tokens only); the later samples' reuse of its blocks shows in the prefix-cache metrics."""
    firsts = [a for a in answers if not a.repeats_prompt]
    return usage(sum(a.prompt_tokens for a in firsts), sum(a.completion_tokens for a in answers),
                 sum(a.cached_tokens for a in firsts))


def headers(answers: list[Answer]) -> dict[str, str]:
    """One answer's headers; for several, X-Strata-Cache lists each choice's layer in order."""
    if len(answers) == 1:
        return answers[0].headers()
    return {"X-Strata-Cache": ", ".join(a.layer for a in answers)}


def strata(answers: list[Answer]) -> dict | list[dict]:
    """The body's `strata`: one answer's object, or one per choice."""
    return answers[0].strata() if len(answers) == 1 else [a.strata() for a in answers]


def release(answers: list[Answer]) -> None:
    for answer in answers:
        answer.release()
