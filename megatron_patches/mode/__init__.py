"""The contract between the training loop and an MoE parallel mode (--moe-parallel-mode).

- `spec.ModeSpec`: what a mode declares before any process group exists (its flags, their
  validation, its runtime class); torch-free, read by the argument parser.
- `runtime.ModeRuntime`: the steps the training loop calls, in the order it calls them. Its
  own implementation of every step is stock Megatron-Core expert parallelism, so `ep` is this
  class itself; fssdp, replicate and zebra subclass it in their packages.
- `envelope`: the refusals shared by the modes that place expert instances over Megatron's
  expert-parallel group (fssdp, replicate).

The registry of modes is `training/modes.py` (one line per mode). docs/architecture.md,
"How to add a mode", walks through the steps.
"""
