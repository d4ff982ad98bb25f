"""Zebra mode (DESIGN 4.7, 4.8): attention/expert disaggregation over mixed GPU pools.

- `pools`: which ranks of a cluster do attention and which expert work, the ZP and
  data-parallel groups as plain data, and the validation of a pool against the model and a
  profile.
- `profiler`: per-micro-batch times and memory of one device type (tools/profile_moe.py),
  merged into the profile file that Asym-EA (`placement.zebra`) reads.
- `config`: ZebraConfig and the `--zebra-*` flags (`add_zebra_args`).
- `engine`: ZebraEngine, the zig-zag forward/backward schedule over Megatron-Core's own
  modules (attention ranks: embedding, attention, router, head; expert ranks: the experts),
  Asym-EA owners, the AdamW step with Megatron's groups and clipping.
- `timeline`: start/end of every task per rank and stream, bubble fractions
  (tools/plot_timeline.py draws them).

The training loop runs it as `--moe-parallel-mode zebra` (training/loop.py through `zebra/runtime.py`).

The planning side (profile format, Asym-EA, task order) lives in `megatron_patches.placement.zebra`.
"""
