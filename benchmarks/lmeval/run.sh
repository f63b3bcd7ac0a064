#!/usr/bin/env bash
# lm-evaluation-harness (local-completions, loglikelihood) against `strata serve` on the local task
# strata_simple_qa, then the Hugging Face oracle (check_against_hf.py) on lm-eval's per-sample log.
#
#   LMEVAL_VENV=/path/to/lmeval-venv benchmarks/lmeval/run.sh
#
# Environment (all optional except LMEVAL_VENV):
#   LMEVAL_VENV   venv with lm-eval[api]==0.4.13 (and its torch/transformers); its bin/lm_eval and bin/python are used
#   STRATA        the strata command (default: strata on PATH)
#   STRATA_HOME   strata's home; the model/tokenizer folder is $STRATA_HOME/models/SmolLM2-135M-Instruct
#                 (default home ~/.cache/strata; run `strata serve` once to create the folder)
#   PORT          port for the server on 127.0.0.1 (default: a free one)
#   BATCH_SIZE    lm-eval --batch_size (default 1; >1 sends a list of token-id prompts per request)
#   OUT           output folder (default benchmarks/results/lmeval)
#   TIMEOUT_S     bound on the lm_eval run (default 900)
#   SERVER_LOG    where the server's log goes (default: a temporary file)
# Nothing is fetched from the Hugging Face hub: HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1 are set here.
set -euo pipefail
cd "$(dirname "$0")/../.."   # repository root: the task's data_files path is relative to it

: "${LMEVAL_VENV:?set LMEVAL_VENV to the venv holding lm-eval}"
STRATA=${STRATA:-strata}
MODEL_DIR=${STRATA_HOME:-$HOME/.cache/strata}/models/SmolLM2-135M-Instruct
PORT=${PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
BATCH_SIZE=${BATCH_SIZE:-1}
OUT=${OUT:-benchmarks/results/lmeval}
TIMEOUT_S=${TIMEOUT_S:-900}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT"
SERVER_LOG=${SERVER_LOG:-$(mktemp)}

"$STRATA" serve --host 127.0.0.1 --port "$PORT" --cache-db none --num-threads 1 > "$SERVER_LOG" 2>&1 &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 "$SERVER_PID" 2>/dev/null || { echo "strata serve exited; see $SERVER_LOG" >&2; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || { echo "strata serve not ready after 300 s" >&2; exit 1; }

set -x
timeout "$TIMEOUT_S" "$LMEVAL_VENV/bin/lm_eval" --model local-completions \
  --model_args "model=SmolLM2-135M-Instruct,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$MODEL_DIR,tokenizer_backend=huggingface,num_concurrent=1,max_retries=1" \
  --tasks strata_simple_qa --include_path benchmarks/lmeval --batch_size "$BATCH_SIZE" \
  --output_path "$OUT" --log_samples 2>&1 | tee "$OUT/lm_eval.log"
SAMPLES=$(ls -t "$OUT"/SmolLM2-135M-Instruct/samples_strata_simple_qa_*.jsonl | head -1)
"$LMEVAL_VENV/bin/python" benchmarks/lmeval/check_against_hf.py --model "$MODEL_DIR" --samples "$SAMPLES" \
  2>&1 | tee "$OUT/check_against_hf.txt"
