#!/usr/bin/env bash
# Every comparison quoted in docs/evaluation.md, reproducible: needs the public traces in
# ../shared/traces. Writes out/eval/<run>/{report.json,table.md,*.png}. About two hours on two
# idle cores (the three groups run side by side; the knee sweep is the longest).
set -euo pipefail
cd "$(dirname "$0")/.."
K=.venv/bin/kvsched
T=../shared/traces
W=$T/weka_cc_agentic/weka_cc_agentic_calls.jsonl.xz
C=$T/conversation_trace.jsonl
S=$T/synthetic_trace.jsonl
A=$T/azure_llm_2023/AzureLLMInferenceTrace_conv.csv
ABLATION=ear,elastic,elastic:idle_migration=0,elastic:ttft_target=0,elastic:global_index=0,elastic:replicate=0,elastic:admission=0
WEKA=(--instances 8 --load 64 --max-gap 300 --quiet)
OPEN=(--instances 8 --quiet)
mkdir -p out/eval

agentic() {
    $K replay --trace "$W" --policies all --seed 0 "${WEKA[@]}" --out out/eval/weka
    $K replay --trace "$W" --policies "$ABLATION" --seed 0 "${WEKA[@]}" --no-figures --out out/eval/weka_ablation
    $K replay --trace "$W" --sessions 180:360 --policies all --seed 0 "${WEKA[@]}" --no-figures --out out/eval/weka_heldout
    for seed in 1 2; do
        $K replay --trace "$W" --policies dynamo,mooncake,sticky,ear,elastic --seed "$seed" "${WEKA[@]}" \
            --no-figures --out "out/eval/weka_seed$seed"
    done
    $K replay --trace "$W" --shared-prefix "$T/weka_cc_agentic/weka_cc_agentic_trace_meta.json" \
        --policies "cache_aware,sticky,$ABLATION" --seed 0 "${WEKA[@]}" --no-figures --out out/eval/weka_shared
    $K replay --trace "$W" --sessions 0:180 --policies all --seed 0 "${WEKA[@]}" --sweep 16,32,128,256 \
        --no-figures --out out/eval/weka_sweep
}

# The agentic capacity knee: 4 instances, copies of each session grow with the load (the start
# window keeps its length, about 6 h of simulated time), warm-up = the first 15% of it, each
# policy stops at its first load below 90% attainment. About 80 CPU-minutes for the three seeds;
# `tools/eval_tables.py --seeds out/eval/weka_knee_seed0 out/eval/weka_knee_seed1 ...`.
knee() {
    for seed in 0 1 2; do
        $K replay --trace "$W" --sessions 0:180 --repeat 2 --warmup 0.15 --policies all \
            --seed "$seed" --instances 4 --load 32 --max-gap 300 --sweep 48,64,96,128,192,256 \
            --sweep-scale-repeat --quiet --no-figures --out "out/eval/weka_knee_seed$seed"
    done
    # The reuse-aware policies all pass 64 and miss 96: a finer grid between them (load 64 with
    # 4 copies is the same replay as in the sweep above).
    for seed in 0 1 2; do
        $K replay --trace "$W" --sessions 0:180 --repeat 4 --warmup 0.15 \
            --policies cache_aware,dynamo,lmetric,sticky,ear,elastic --seed "$seed" --instances 4 \
            --load 64 --max-gap 300 --sweep 72,80,88 --sweep-scale-repeat --quiet --no-figures \
            --out "out/eval/weka_knee_fine_seed$seed"
    done
}

open_loop() {
    $K replay --trace "$C" --policies all --seed 0 --load 1 "${OPEN[@]}" --out out/eval/conv
    $K replay --trace "$C" --policies "$ABLATION" --seed 0 --load 1 "${OPEN[@]}" --no-figures --out out/eval/conv_ablation
    $K replay --trace "$S" --policies all --seed 0 --load 1 "${OPEN[@]}" --out out/eval/synth
    $K replay --trace "$A" --policies all --seed 0 --load 16 "${OPEN[@]}" --no-figures --out out/eval/azure
    $K replay --trace "$C" --policies all --seed 0 --load 1 --sweep 0.5,1.5,2,3,3.25,3.5,4 "${OPEN[@]}" --no-figures --out out/eval/conv_sweep
    $K replay --trace "$S" --policies all --seed 0 --load 1 --sweep 0.5,1.5,2,3,3.25,3.5,4 "${OPEN[@]}" --no-figures --out out/eval/synth_sweep
}

# Every trace with the node pool (a DRAM tier of 4x each node's GPU KV), beside the runs above
# without it (`tools/eval_tables.py --tiers out/eval/conv out/eval/conv_tier4`), and `elastic`'s
# parallel-call spill (g), off by default, with and without the tier.
tiers() {
    $K replay --trace "$C" --policies all --seed 0 --load 1 "${OPEN[@]}" --dram-tier 4 --no-figures --out out/eval/conv_tier4
    $K replay --trace "$S" --policies all --seed 0 --load 1 "${OPEN[@]}" --dram-tier 4 --no-figures --out out/eval/synth_tier4
    $K replay --trace "$A" --policies all --seed 0 --load 16 "${OPEN[@]}" --dram-tier 4 --no-figures --out out/eval/azure_tier4
    $K replay --trace "$W" --policies all --seed 0 "${WEKA[@]}" --dram-tier 4 --no-figures --out out/eval/weka_tier4
    for tier in 0 4; do
        $K replay --trace "$W" --policies elastic:fanout=1 --seed 0 "${WEKA[@]}" --dram-tier "$tier" \
            --no-figures --out "out/eval/weka_fanout_tier$tier"
        $K replay --trace "$C" --policies elastic:fanout=1 --seed 0 --load 1 "${OPEN[@]}" \
            --dram-tier "$tier" --no-figures --out "out/eval/conv_fanout_tier$tier"
        $K replay --trace "$S" --policies elastic:fanout=1 --seed 0 --load 1 "${OPEN[@]}" \
            --dram-tier "$tier" --no-figures --out "out/eval/synth_fanout_tier$tier"
    done
    for seed in 1 2; do
        $K replay --trace "$W" --policies elastic:fanout=1 --seed "$seed" "${WEKA[@]}" --no-figures \
            --out "out/eval/weka_fanout_seed$seed"
    done
    for seed in 0 1 2; do
        $K replay --trace "$W" --sessions 0:180 --repeat 4 --warmup 0.15 --policies elastic:fanout=1 \
            --seed "$seed" --instances 4 --load 64 --max-gap 300 --sweep 72,80,88,96 \
            --sweep-scale-repeat --quiet --no-figures --out "out/eval/weka_knee_fanout_seed$seed"
    done
}

agentic > out/eval/agentic.log 2>&1 &
knee > out/eval/knee.log 2>&1 &
open_loop > out/eval/open_loop.log 2>&1
tiers > out/eval/tiers.log 2>&1
wait
for run in out/eval/*/; do echo "== $run"; cat "$run/table.md"; echo; done
