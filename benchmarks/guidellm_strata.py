"""Run guidellm's own CLI (`guidellm run ...`) with one change to the requests it sends: no
`stream_options.continuous_usage_stats`.

guidellm 0.8.1 adds `"stream_options": {"include_usage": true, "continuous_usage_stats": true}` to every streaming
request. `continuous_usage_stats` is a vLLM extension (usage in every chunk); `strata serve` does not know it and, as
it does for any unknown field, answers 400 `Unknown parameter: 'stream_options.continuous_usage_stats'`, so every
stock guidellm request errors (docs/benchmarking.md shows that run). guidellm's `extras` merge into the body and
cannot remove a key, hence this wrapper: it drops that one key after guidellm formats a request and leaves the rest
of guidellm (scheduling, timing, token counting from the final `usage` chunk, reports) as it is.

Run it with the Python of the venv guidellm is installed in, with guidellm's arguments:
    /path/to/guidellm-venv/bin/python benchmarks/guidellm_strata.py run --backend ... --data ... --profile ...
"""

import sys

from guidellm.backends.openai import request_handlers
from guidellm.cli import cli


def _without_continuous_usage(cls: type) -> None:
    original = cls.format

    def format(self, *args, **kwargs):  # noqa: A001 - the method's own name in guidellm
        arguments = original(self, *args, **kwargs)
        options = (arguments.body or {}).get("stream_options")
        if isinstance(options, dict):
            options.pop("continuous_usage_stats", None)
        return arguments

    cls.format = format


for handler in (request_handlers.TextCompletionsRequestHandler, request_handlers.ChatCompletionsRequestHandler):
    _without_continuous_usage(handler)

if __name__ == "__main__":
    sys.exit(cli())
