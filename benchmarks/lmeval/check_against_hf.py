"""Oracle for the lm-evaluation-harness run against `strata serve`: are its scores the model's own?

Recomputes every (context, continuation) log-likelihood of the strata_simple_qa task in-process with Hugging Face
transformers (AutoModelForCausalLM from the same local folder, fp32), tokenized the way lm-eval 0.4.13 does it for
`local-completions` (`TemplateLM._encode_pair`: trailing spaces of the context move to the continuation, the
continuation's tokens are encode(context + continuation)[len(encode(context)):], no special tokens), and compares
them, choice by choice and example by example, with lm-eval's per-sample log (`--log_samples`).

    python benchmarks/lmeval/check_against_hf.py --model MODEL_DIR --samples SAMPLES.jsonl [--data simple_qa.jsonl]

Runs with the lm-eval venv's python (torch + transformers); offline (HF_HUB_OFFLINE=1).
"""

import argparse
import json
import math
import pathlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = pathlib.Path(__file__).resolve().parent


def doc_to_text(doc: dict) -> str:
    return f"Question: {doc['question']}\nAnswer:"  # as strata_simple_qa.yaml's doc_to_text


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


@torch.no_grad()
def loglikelihood(model, ctx: list[int], cont: list[int]) -> float:
    ids = torch.tensor([ctx + cont])
    logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))


def argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=lambda i: xs[i])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local model folder (weights + tokenizer)")
    ap.add_argument("--samples", required=True, help="lm-eval's samples_strata_simple_qa_*.jsonl")
    ap.add_argument("--data", default=str(HERE / "simple_qa.jsonl"))
    ap.add_argument("--tie-eps", type=float, default=1e-3, help="choices closer than this count as a tie")
    args = ap.parse_args()

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    docs = [json.loads(line) for line in open(args.data)]
    served = {}
    for line in open(args.samples):
        s = json.loads(line)
        served[int(s["doc_id"])] = [float(r[0]) for r in s["filtered_resps"]]

    n = agree = agree_norm = acc = acc_norm = acc_hf = acc_norm_hf = ties = 0
    max_diff = 0.0
    for i, doc in enumerate(docs):
        ctx = doc_to_text(doc)
        hf = [loglikelihood(model, *encode_pair(tok, ctx, " " + c)) for c in doc["choices"]]
        sv = served[i]
        lens = [float(len(c)) for c in doc["choices"]]  # lm-eval's acc_norm: divide by the choice's length in chars
        hf_n = [x / ln for x, ln in zip(hf, lens, strict=True)]
        sv_n = [x / ln for x, ln in zip(sv, lens, strict=True)]
        diff = max(abs(a - b) for a, b in zip(hf, sv, strict=True))
        max_diff = max(max_diff, diff)
        srt = sorted(hf)
        tie = srt[-1] - srt[-2] < args.tie_eps
        ties += tie
        same, same_n = argmax(hf) == argmax(sv), argmax(hf_n) == argmax(sv_n)
        agree += same
        agree_norm += same_n
        acc += argmax(sv) == doc["answer"]
        acc_norm += argmax(sv_n) == doc["answer"]
        acc_hf += argmax(hf) == doc["answer"]
        acc_norm_hf += argmax(hf_n) == doc["answer"]
        n += 1
        flag = "" if same and same_n else "  DISAGREE" + (" (tie)" if tie else "")
        print(f"{i:2d} answer={doc['answer']} strata={argmax(sv)} hf={argmax(hf)} "
              f"max|dlogprob|={diff:.2e}{flag}  {doc['question']}")
    print(f"\nexamples: {n}  choices scored: {4 * n}")
    print(f"acc      strata (lm-eval log) {acc / n:.4f}   HF transformers fp32 {acc_hf / n:.4f}")
    print(f"acc_norm strata (lm-eval log) {acc_norm / n:.4f}   HF transformers fp32 {acc_norm_hf / n:.4f}")
    print(f"same chosen answer: acc {agree}/{n}, acc_norm {agree_norm}/{n}; near-ties in HF (< {args.tie_eps}): {ties}")
    print(f"largest |strata - HF| choice log-likelihood: {max_diff:.3e}")
    if not math.isfinite(max_diff) or agree != n or agree_norm != n:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
