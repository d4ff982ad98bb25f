"""fssdp's placement in checkpoints: the common state under "fssdp" beside ep's per-expert form.

The experts are saved under ep's per-expert keys (placement-independent; FSSDPMoELayer's sharded
state dict). The placement is kept as plain numbers (Megatron reads common state with
torch.load(weights_only=True)): every rank's slot table with its stage's shard layout, the load
history, t and the cost model's measured figures (both measured, so not reproducible by a
resumed run). A resume in fssdp adopts them before the weights are read into the slots, so it
continues exactly as the uninterrupted run; a checkpoint from another mode (or another group
size) starts from EP's layout with no load history, and says so.
"""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from megatron_patches.fssdp.config import FSSDPConfig
from megatron_patches.fssdp.reshard import SlotTable
from megatron_patches.fssdp.tuning import FSSDPTuning
from megatron_patches.placement.loads import LoadTracker
from megatron_patches.placement.types import ModelShardLayout

__all__ = ["placement_state_dict", "restore_placement"]


def placement_state_dict(layer_numbers: list[int], rank: int, table: SlotTable, layout: ModelShardLayout,
                         num_devices: int, tracker: LoadTracker, tuning: FSSDPTuning) -> dict:
    """Every rank's slot table with its stage's shard layout, the load history, t and the cost
    model's figures. Collective over the world: each rank adds its table."""
    mine = {"layers": layer_numbers, "rank": rank, "held": table.held_S2.tolist(), "owners": layout.owners_LE.tolist()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    stages: dict[tuple, dict] = {}
    for entry in every:
        stage = stages.setdefault(tuple(entry["layers"]), {"layers": entry["layers"], "owners": entry["owners"],
                                                            "tables": [None] * num_devices})
        stage["tables"][entry["rank"]] = entry["held"]
    history = tracker.state_dict()
    cost = tuning.cost
    return {
        "num_devices": num_devices,
        "stages": list(stages.values()),
        "observed": int(history["observed"]),
        "history_loads": history["history_loads"].tolist(),
        "overlap_degree": tuning.t,
        "calibration_seconds_per_token": None if cost is None else cost.seconds_per_token,
        "calibration_hidden_backward_s": None if cost is None else cost.reduce_hidden_s,
        "calibration_seconds_per_instance": None if cost is None else cost.seconds_per_instance,
    }


def restore_placement(state: dict | None, config: FSSDPConfig, layer_numbers: list[int], moe_layer_numbers: list[int],
                      rank: int, table: SlotTable, num_devices: int, num_experts: int, tracker: LoadTracker,
                      tuning: FSSDPTuning) -> tuple[ModelShardLayout | None, SlotTable | None, list[str]]:
    """Adopts a saved placement (after attach, before the weights are read): the restored (layout,
    slot table), None for both when the saved one does not apply, and log notes. The tracker's
    history and the tuning's t and cost model are restored in place.

    A placement saved in another mode, with another group size or other MoE layers does not
    apply: the run starts from EP's layout with no load history and says so. A saved t
    applies when --fssdp-overlap-degree is auto (the flag wins otherwise)."""
    if state is None:
        return None, None, ["fssdp: the checkpoint holds no fssdp placement (saved in another mode); experts start "
                            "from EP's layout with no load history"]
    stage = next((s for s in state["stages"] if s["layers"] == layer_numbers), None)
    history = np.asarray(state["history_loads"], dtype=np.int64)
    if history.size == 0:
        history = history.reshape(0, len(moe_layer_numbers), num_experts)
    if (state["num_devices"] != num_devices or stage is None
            or history.shape[1:] != (len(moe_layer_numbers), num_experts)):
        return None, None, [f"fssdp: the saved placement ({state['num_devices']} ranks) does not fit {num_devices} "
                            f"ranks and MoE layers {layer_numbers}; experts start from EP's layout with no load history"]
    layout = ModelShardLayout(np.asarray(stage["owners"], dtype=np.int64), num_devices)
    restored = SlotTable(np.asarray(stage["tables"][rank], dtype=np.int64), table.slots_per_layer)
    restored.check(layout, rank)
    tracker.load_state_dict({"observed": state["observed"], "history_loads": history})
    notes = [f"fssdp: restored the shard layout (experts owned per layer and rank {layout.counts_LD().tolist()}) "
             f"and {tracker.num_observed} observed iterations of loads"]
    if config.overlap_degree is None and state["overlap_degree"] is not None:
        tuning.t = int(state["overlap_degree"])
        notes.append(f"fssdp: overlap degree t = {tuning.t} from the checkpoint (auto t measured by the saving run)")
    seconds = state["calibration_seconds_per_token"]
    if (config.calibrate or config.overlap_degree is None) and seconds is not None:
        # the measured times; the copy's bytes are this run's (its dtype may differ)
        tuning.cost = tuning.cost_model(float(seconds), float(state.get("calibration_hidden_backward_s") or 0.0),
                                        float(state.get("calibration_seconds_per_instance") or 0.0))
    return layout, restored, notes
