"""Write an aiperf `inputs.json` of /v1/completions requests whose prompts are token-id lists of an exact length.

Load generators send token ids to fix prompt lengths exactly (no chat template, no re-tokenization drift); this
makes such a workload from the public-domain text strata ships, for aiperf's `--custom-dataset-type inputs_json`,
which sends each payload verbatim. Usage:

    python benchmarks/token_id_payloads.py --tokenizer DIR --out inputs.json --requests 16 --input-tokens 128
"""

import argparse
import json
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer


def payloads(tokenizer: Tokenizer, model: str, requests: int, input_tokens: int, output_tokens: int) -> list[dict]:
    """One streaming completions body per request; prompt i is the i-th disjoint window of the text's token ids."""
    text = resources.files("strata.server.bench").joinpath("data/public_domain_en.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) < requests * input_tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {requests} x {input_tokens}")
    return [
        {
            "model": model,
            "prompt": ids[i * input_tokens : (i + 1) * input_tokens],
            "max_tokens": output_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(requests)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="folder holding the served model's tokenizer.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    bodies = payloads(tokenizer, args.model, args.requests, args.input_tokens, args.output_tokens)
    sessions = [{"session_id": f"token-ids-{i}", "payloads": [body]} for i, body in enumerate(bodies)]
    args.out.write_text(json.dumps({"data": sessions}), encoding="utf-8")
    print(json.dumps({"out": str(args.out), "requests": len(bodies), "input_tokens": args.input_tokens}))


if __name__ == "__main__":
    main()
