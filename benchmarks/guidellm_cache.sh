#!/usr/bin/env bash
# guidellm against `strata serve`, same repeated-prompt workload with and without the request cache.
#
# Starts one `strata serve` per run on 127.0.0.1 (in-memory cache), runs guidellm's synchronous profile over a
# small prompt set in which every prompt comes back REPEATS times, stops the server, and writes
#   $OUT/with_cache.json, $OUT/without_cache.json   (guidellm's own JSON reports)
#   $OUT/with_cache.txt,  $OUT/without_cache.txt    (guidellm's console output)
#   $OUT/summary.json                               (ratios, machine, load average)
#
# Everything comes from the environment; nothing here names a machine path:
#   PYTHON_GUIDELLM  python of the venv guidellm is installed in (not GUIDELLM_*: guidellm warns about GUIDELLM_
#                  variables it does not know) (default: python3; install guidellm in its own venv:
#                  python3 -m venv gl && gl/bin/pip install torch==2.13.0 guidellm==0.8.1); stock guidellm, unmodified
#   STRATA         strata executable (default: strata on PATH)
#   TOKENIZER      tokenizer folder guidellm reads (default: $STRATA_HOME or ~/.cache/strata, models/SmolLM2-135M-Instruct,
#                  the folder strata converts the default model into); nothing is fetched from a model hub
#   OUT            output folder (default: benchmarks/results/guidellm)
#   PORT           port (default: a free one)
#   DISTINCT       distinct prompts (default 8)      REPEATS  times each prompt is sent (default 4)
#   OUTPUT_TOKENS  tokens per answer, ignore_eos (default 32)
#   NUM_THREADS    torch threads of the engine (default 1: the other core is left to HTTP and guidellm)
#   MAX_SECONDS    guidellm's time bound per run (default 600); the request count is DISTINCT * REPEATS
#   STARTUP_S      how long to wait for the server to answer /v1/models (default 600)
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
PYTHON_GUIDELLM="${PYTHON_GUIDELLM:-python3}"
STRATA="${STRATA:-strata}"
STRATA_HOME_DIR="${STRATA_HOME:-$HOME/.cache/strata}"
TOKENIZER="${TOKENIZER:-$STRATA_HOME_DIR/models/SmolLM2-135M-Instruct}"
OUT="${OUT:-$here/results/guidellm}"
DISTINCT="${DISTINCT:-8}"
REPEATS="${REPEATS:-4}"
OUTPUT_TOKENS="${OUTPUT_TOKENS:-32}"
NUM_THREADS="${NUM_THREADS:-1}"
MAX_SECONDS="${MAX_SECONDS:-600}"
STARTUP_S="${STARTUP_S:-600}"
PORT="${PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
REQUESTS=$((DISTINCT * REPEATS))
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

[ -f "$TOKENIZER/tokenizer.json" ] || {
  echo "no tokenizer.json in $TOKENIZER: run strata once (it converts the default model) or set TOKENIZER" >&2
  exit 2
}
mkdir -p "$OUT"
work="$(mktemp -d)"
server_pid=""
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill "$server_pid"
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# The prompt set: DISTINCT prompts of ~70-110 tokens, sent in rounds (p0..pN-1, p0..pN-1, ...), so the first round
# misses and every later round repeats a prompt the cache has already answered.
python3 - "$work/prompts.jsonl" "$DISTINCT" "$REPEATS" "$OUTPUT_TOKENS" <<'EOF'
import json
import sys

path, distinct, repeats, out_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
topics = ["a lighthouse keeper", "a bakery at dawn", "a mountain railway", "a city library", "a fishing village",
          "a night market", "an old observatory", "a desert caravan", "a river ferry", "a winter orchard",
          "a clock repair shop", "a harbour crane", "a school garden", "a radio station", "a glass workshop",
          "a mountain hut"]
rows = []
for i in range(distinct):
    topic = topics[i % len(topics)] + ("" if i < len(topics) else f" (variant {i // len(topics)})")
    prompt = (f"Write a short, calm paragraph about {topic}. Describe what a visitor sees, hears and smells in the "
              f"first hour of the morning, name two people who work there and what each of them is doing, and end "
              f"with one sentence about why the place matters to the town around it. Use plain words, present "
              f"tense, and no lists. This is request family number {i}.")
    rows.append({"prompt": prompt, "output_tokens_count": out_tokens})
with open(path, "w") as f:
    for _ in range(repeats):
        for row in rows:
            f.write(json.dumps(row) + "\n")
EOF

run_one() {  # $1 = name, $2... = extra strata serve flags
  local name="$1"
  shift
  "$STRATA" serve --host 127.0.0.1 --port "$PORT" --cache-db none --num-threads "$NUM_THREADS" "$@" \
    >"$work/serve_$name.log" 2>&1 &
  server_pid=$!
  local waited=0
  until curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null; do
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/serve_$name.log" >&2; exit 1; }
    sleep 2
    waited=$((waited + 2))
    [ "$waited" -lt "$STARTUP_S" ] || { echo "server did not answer in ${STARTUP_S}s" >&2; exit 1; }
  done
  local model
  model="$(curl -s "http://127.0.0.1:$PORT/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')"
  echo "== $name: strata serve --cache-db none --num-threads $NUM_THREADS ${*:-(request cache on, the default)} on 127.0.0.1:$PORT, model $model, $REQUESTS requests" | tee "$OUT/$name.txt"
  # temperature 0: the request cache serves sampled (temperature > 0) answers only when a seed is given
  "$PYTHON_GUIDELLM" -m guidellm run \
    --backend "{\"kind\": \"openai_http\", \"target\": \"http://127.0.0.1:$PORT\", \"model\": \"$model\", \"request_format\": \"/v1/chat/completions\", \"extras\": {\"body\": {\"temperature\": 0}}}" \
    --tokenizer "kind=huggingface_auto,model=$TOKENIZER" \
    --data "kind=json_file,path=$work/prompts.jsonl" \
    --profile kind=synchronous \
    --constraint "kind=max_requests,count=$REQUESTS" \
    --constraint "kind=max_duration,seconds=$MAX_SECONDS" \
    --output "kind=json,path=$OUT/$name.json" \
    --disable-console-interactive 2>&1 | tee -a "$OUT/$name.txt"
  # what the server itself counted (exact / semantic hits, misses)
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^strata_(request_)?cache' | head -20 >"$work/metrics_$name.txt" || true
  kill "$server_pid"
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
}

run_one with_cache
run_one without_cache --no-request-cache

python3 "$here/guidellm_summary.py" "$OUT/with_cache.json" "$OUT/without_cache.json" \
  --requests "$REQUESTS" --distinct "$DISTINCT" --repeats "$REPEATS" --output-tokens "$OUTPUT_TOKENS" \
  --num-threads "$NUM_THREADS" --metrics-with "$work/metrics_with_cache.txt" >"$OUT/summary.json"
cat "$OUT/summary.json"
