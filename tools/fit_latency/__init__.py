"""Fit the engine step-time model of `kvsched.core.latency` from measured GPU profiles.

    python -m tools.fit_latency [--profiles PATH]

PATH defaults to `../shared/profiles` next to the repository root. The script reads the BLIS,
Vidur and Splitwise files described in that folder's README.md, fits

    step = step_s + prefill_token_s·p + attn_pair_s·pairs + decode_seq_s·B + decode_ctx_s·ctx

for Llama-3.1-8B on H100 (TP1, bf16), Meta-Llama-3-8B on A100-80GB (TP1, bf16) and
Llama-3.1-70B on four H100s (TP4, bf16), prints the constants with their fit statistics and
cross-checks, and writes
`kvsched/data/latency/{llama-3.1-8b-h100,llama-3-8b-a100,llama-3.1-70b-h100-tp4}.json`.
docs/latency-model.md explains every choice made here.

    python -m tools.fit_latency --engine URL [--name NAME] [--chunk-tokens N] [--out DIR]

instead times a running, idle vLLM OpenAI server (the CPU build serving a tiny model, say)
and fits the same five constants to it, its KV capacity read from its metrics, writing
`DIR/NAME.json` (default `out/latency/vllm-cpu.json`): a profile `kvsched replay
--latency-profile` and `kvsched up --latency-profile` take, to check the simulator against
that engine (docs/evaluation.md, "The simulator against a real engine").

Modules: `files` (where the profiles are), `numeric` (line fits), `blis` (BLIS coefficients and
GPU specs), `vidur` (Vidur's per-op and attention profiles), `scaling` (A100/H100 ratios and KV
capacity), `profiles` (the three fits), `provenance` (sources and method texts), `output`
(the JSON and the printout), and for a running engine `engine_probes` (the timed requests)
and `engine_fit` (the fit to them).
"""
