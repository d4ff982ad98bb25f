"""FSSDP mode (--moe-parallel-mode fssdp): fully sharded sparse data parallelism for the experts.

- `config.FSSDPConfig`: the mode's settings from the command line;
- `runtime.FSSDPRuntime`: plans, sparse collectives and gradient flow for a stage's MoE layers;
- `layer.FSSDPMoELayer`: Megatron's MoELayer computing on materialized expert copies.

Use: build the runtime, pass `runtime.moe_spec` as the model's `moe_spec_fn`, then after DDP
`runtime.attach(transformer layers, config)`; per iteration `begin_iteration` / `end_iteration`.
"""

from megatron_patches.fssdp.config import FSSDPConfig
from megatron_patches.fssdp.runtime import FSSDPRuntime

__all__ = ["FSSDPConfig", "FSSDPRuntime"]
