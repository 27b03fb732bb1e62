#!/usr/bin/env bash
# The simulator against a real engine (docs/evaluation.md, "The simulator against a real
# engine"): start `kvsched up --engine vllm` (two vLLM CPU engines serving the tiny model,
# one node), fit a latency profile to one of them while the cluster is idle
# (`python -m tools.fit_latency --engine URL`), start the cluster again with its Conductor
# pricing placements by that profile, replay a slice of WEKA agentic sessions through its
# Routers (`kvsched bench`) and in the simulator with the same profile and KV capacity, and
# print the two side by side. Needs `scripts/setup --vllm`. Writes out/fidelity/ (the profile
# vllm-cpu-tiny-llama.json, report.json, the clusters' logs). Extra arguments go to
# `kvsched bench` (e.g. another --sessions slice). About 10 minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=out/fidelity
profile=$out/vllm-cpu-tiny-llama.json
mkdir -p "$out"
up=""
stop_cluster() {
    if [ -n "$up" ]; then
        kill -INT "$up" 2>/dev/null || true
        wait "$up" || true
        up=""
    fi
}
trap stop_cluster EXIT
start_cluster() {  # start_cluster NAME [kvsched up flags]
    local name=$1
    shift
    rm -f "$out/$name.endpoints.json"
    .venv/bin/kvsched up --engine vllm --model out/models/tiny-llama --nodes 1 \
        --engines-per-node 2 --routers 1 --block-size 64 --quiet \
        --endpoints-file "$out/$name.endpoints.json" --run-dir "$out/$name" "$@" &
    up=$!
    for _ in $(seq 3000); do # up to 5 minutes for vLLM to load and serve
        [ -s "$out/$name.endpoints.json" ] && return 0
        kill -0 "$up" 2>/dev/null || { echo "kvsched up failed" >&2; exit 1; }
        sleep 0.1
    done
    echo "kvsched up did not start in time" >&2
    exit 1
}
engine_url() {
    .venv/bin/python -c 'import json, sys; print(json.load(open(sys.argv[1]))["engines"][0]["url"])' "$1"
}

start_cluster fit
.venv/bin/python -m tools.fit_latency --engine "$(engine_url "$out/fit.endpoints.json")" \
    --name vllm-cpu-tiny-llama --device "vLLM CPU build, $(nproc) cores shared by 2 engines" \
    --out "$out"
stop_cluster

start_cluster replay --latency-profile "$profile"
.venv/bin/kvsched bench --endpoints "$out/replay.endpoints.json" \
    --trace data/traces/weka_cc_agentic_sample.jsonl.xz --sessions 11:16 --max-gap 2 \
    --load 50 --quiet --out "$out" "$@"
