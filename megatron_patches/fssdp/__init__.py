"""FSSDP mode (--moe-parallel-mode fssdp): fully sharded sparse data parallelism for the experts.

- `config`: the `--fssdp-*` flags, their validation and FSSDPConfig (torch-free; the mode's
  ModeSpec is `config.MODE`);
- `runtime.FSSDPRuntime`: the mode's ModeRuntime: plans, sparse collectives and gradient flow
  for a stage's MoE layers;
- `layer.FSSDPMoELayer`: Megatron's MoELayer computing on materialized expert copies;
- `reshard`: the slot table and the batched exchange that moves experts to new owners.

The training loop drives the runtime through the ModeRuntime steps (megatron_patches/mode).
"""
