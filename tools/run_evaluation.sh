#!/usr/bin/env bash
# Every comparison quoted in docs/evaluation.md, reproducible: needs the public traces in
# ../shared/traces. Writes out/eval/<run>/{report.json,table.md,*.png} (a knee search:
# knee.json). The full run takes several hours on two idle cores (the groups run side by side;
# the memory-bound knee searches are the longest). `--quick`: only the memory-bound knee
# without the tier, on half the held-out sessions, three seeds, to 5% of load
# (out/eval/quick_knee).
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        *)
            echo "run_evaluation: unknown option $arg (--quick)" >&2
            exit 2
            ;;
    esac
done
K=.venv/bin/kvsched
T=../shared/traces
W=$T/weka_cc_agentic/weka_cc_agentic_calls.jsonl.xz
C=$T/conversation_trace.jsonl
S=$T/synthetic_trace.jsonl
A=$T/azure_llm_2023/AzureLLMInferenceTrace_conv.csv
ABLATION=ear,elastic,elastic:idle_migration=0,elastic:ttft_target=0,elastic:global_index=0,elastic:replicate=0,elastic:admission=0
WEKA=(--instances 8 --load 64 --max-gap 300 --quiet)
OPEN=(--instances 8 --quiet)
PEERS=llmd,dynamo,sglang,mooncake,cache_aware
mkdir -p out/eval

# The memory-bound agentic regime: the held-out sessions (traces 180-359) on 4 instances
# whose 40 GiB GPUs hold about 172K tokens of KV each, so the sessions in flight at the knee
# do not all fit; the knee of `elastic`, `ear` and each peer's scorer by bisection to 2% of
# load over five seeds, then every policy replayed at each seed's best peer's goodput load.
# Without and with the node pool (a DRAM tier of 2.25x the node's GPU KV, Mooncake's ratio
# below; there the knees of `elastic`, `ear` and the two best peers). Without the tier: 117
# minutes of one core. With it the knees lie near loads 72-92 (seed 0: elastic 75.56, llmd and
# dynamo 85.5), where a replay carries about 7.5 copies of each session: a probe that misses
# stops once its miss is certain, and still a seed takes about 80 minutes of a core, so more
# than seven hours in all (seeds 0 and 1 are kept in data/runs/knee_memory_tier). Each finished seed is
# kept under its --out (seeds/): run again, a group goes on from those.
# `tools/eval_tables.py --knee out/eval/knee_memory`.
MEMORY=(--trace "$W" --sessions 180:360 --repeat 2 --load 24 --warmup 0.15 --max-gap 300
    --instances 4 --gpu-memory 40 --bracket 40:52 --quiet --policies all)
memory_bound() {
    $K knee "${MEMORY[@]}" --search "$PEERS,ear,elastic" --out out/eval/knee_memory &
    $K knee "${MEMORY[@]}" --search llmd,dynamo,ear,elastic --dram-tier 2.25 --bracket 78:98 \
        --out out/eval/knee_memory_tier &
    wait
}

# Mooncake's scheduling experiment on its own conversation trace (FAST'25 section 4.2: one
# instance a node, the trace at its timestamps; global cache-aware against local cache-aware,
# load balancing and random, by average TTFT). 8 instances, one a node, each node's DRAM pool
# 2.25x its GPU KV (the paper's 3M tokens of DRAM a node against the ~1.33M its eight A800s
# hold for LLaMA3-70B), the paper's SLOs (TTFT 30 s, TBT 100 ms); Mooncake's disaggregated
# selection (global: fetch the best prefix; local: never fetch), load balancing in the same
# disaggregated cluster (static_pd), and colocated: least_loaded, mooncake:colocated=1,
# elastic, round_robin.
mooncake_direction() {
    $K replay --trace "$C" "${OPEN[@]}" --instances-per-node 1 --dram-tier 2.25 --ttft-slo 30 \
        --tpot-slo 0.1 --load 1 --sweep 1.5,2,2.5,3,4 --no-figures \
        --policies mooncake,mooncake:balancing_threshold=1e9,static_pd,round_robin,least_loaded,mooncake:colocated=1,elastic \
        --out out/eval/mooncake_direction
}

if [ "$QUICK" = 1 ]; then
    $K knee --trace "$W" --sessions 180:270 --repeat 2 --load 24 --warmup 0.15 --max-gap 300 \
        --instances 4 --gpu-memory 40 --bracket 40:52 --tolerance 0.05 --seeds 0,1,2 --jobs 2 \
        --quiet --policies all --search "$PEERS,ear,elastic" --out out/eval/quick_knee
    .venv/bin/python tools/eval_tables.py --knee out/eval/quick_knee
    exit 0
fi

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

memory_bound > out/eval/memory_bound.log 2>&1 &
mooncake_direction > out/eval/mooncake_direction.log 2>&1
agentic > out/eval/agentic.log 2>&1 &
knee > out/eval/knee.log 2>&1 &
open_loop > out/eval/open_loop.log 2>&1
tiers > out/eval/tiers.log 2>&1
wait
for run in out/eval/knee_memory out/eval/knee_memory_tier; do
    echo "== $run"; .venv/bin/python tools/eval_tables.py --knee "$run"; echo
done
for run in out/eval/*/; do [ -f "$run/table.md" ] && { echo "== $run"; cat "$run/table.md"; echo; }; done
