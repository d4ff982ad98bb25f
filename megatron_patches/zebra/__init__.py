"""Zebra mode (DESIGN 4.7, 4.8): attention/expert disaggregation over mixed GPU pools.

- `pools`: which ranks of a cluster do attention and which expert work, the ZP and
  data-parallel groups as plain data, and the validation of a pool against the model and a
  profile.
- `profiler`: per-micro-batch times and memory of one device type (tools/profile_moe.py),
  merged into the profile file that Asym-EA (`placement.zebra`) reads.

The planning side (profile format, Asym-EA, task order) lives in `megatron_patches.placement.zebra`.
"""
