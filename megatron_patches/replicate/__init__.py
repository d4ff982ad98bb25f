"""Replicate mode's runtime: adaptive per-iteration expert replication with a decoupled optimizer.

DESIGN 4.6. The planning (replica counts, balanced slot assignment, token spreading) is pure numpy in `placement.replicate`; this package moves the tensors of one MoE
layer's experts:

- `ExpertSlices` (`slices`): rank r's never-moving slice r of every expert's fp32 master
  weights and Adam state, stepped with torch's functional Adam, optionally in host memory;
- `SlotWeights` (`slots`): the rank's [s, N] slot buffer and the assignment it holds;
- `ReplicatedExperts` (`experts`): the popularity all-reduce, the gradient path (intra-rank sum,
  a sparse reduce-scatter to the slice owners in the EP group), the step and the weight push
  into the next placement's slots, with bytes per phase; whole experts to and from an
  expert-granular layout for per-expert checkpoints.

Training integration (imported from their modules, as they need Megatron-Core): `config`
(ReplicateConfig from the command line), `layer` (ReplicateMoELayer, Megatron's MoELayer on
the slots) and `runtime` (ReplicateRuntime: routing under capacity, gradients, the expert
optimizer step beside Megatron's, the next placement by policy, metrics).

The package's top level imports nothing: `config` must stay torch-free (the argument parser,
and every process that re-imports the entry point, imports it).
"""
