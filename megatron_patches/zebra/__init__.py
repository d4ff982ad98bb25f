"""Zebra mode (DESIGN 4.7, 4.8): attention/expert disaggregation over mixed GPU pools.

- `pools`: which ranks of a cluster do attention and which expert work, the ZP and
  data-parallel groups as plain data, and the validation of a pool against the model and a
  profile.
- `profiler`: per-micro-batch times and memory of one device type (tools/profile_moe.py),
  merged into the profile file that Asym-EA (`placement.zebra`) reads.
- `config`: ZebraConfig and the `--zebra-*` flags (`add_zebra_args`).
- `engine`: ZebraEngine, the zig-zag forward/backward schedule over Megatron-Core's own
  modules, a thin front over three parts:
  - `ownership`: what this rank trains (attention ranks: embedding, attention, router, head and
    Asym-EA's offloaded experts; expert ranks: the experts), the gradient sums, the AdamW step with
    Megatron's groups and clipping, the expert moves of a re-plan;
  - `tasks`: the attention, expert and head forward/backward and the dispatch/combine all-to-alls;
  - `executor`: the host thread that polls the compute, dispatch and combine queues; the
    timeline clock.
- `timeline`: start/end of every task per rank and stream, bubble fractions
  (tools/plot_timeline.py draws them).

The training loop runs it as `--moe-parallel-mode zebra` (training/loop.py through `zebra/runtime.py`).

The planning side (profile format, Asym-EA, task order) lives in `megatron_patches.placement.zebra`.
"""
