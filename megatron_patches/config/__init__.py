"""Model and cluster configurations (configs/models/*.yaml, configs/clusters/*.yaml).

`models`: ModelConfig (Megatron-LM flag names), its loader and validation, and the exact
Megatron-Core parameter count. `clusters`: ClusterConfig (node groups, GPU types, links), its
loader and validation, and the conversion to the placement engine's Topology.
Pure Python plus PyYAML; `clusters` imports `megatron_patches.placement.types`.
"""

from megatron_patches.config.clusters import (
    ClusterConfig,
    GpuType,
    NodeGroup,
    available_clusters,
    cluster_config_from_dict,
    load_cluster_config,
)
from megatron_patches.config.models import (
    ConfigError,
    ModelConfig,
    available_models,
    count_parameters,
    expert_parameter_count,
    load_model_config,
    model_config_from_dict,
    padded_vocab_size,
)

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "GpuType",
    "ModelConfig",
    "NodeGroup",
    "available_clusters",
    "available_models",
    "cluster_config_from_dict",
    "count_parameters",
    "expert_parameter_count",
    "load_cluster_config",
    "load_model_config",
    "model_config_from_dict",
    "padded_vocab_size",
]
