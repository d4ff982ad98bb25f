"""Communication mechanisms over torch.distributed for the placement modes (DESIGN 2, 3).

`groups` (ring all-reduce byte accounting, node layouts), `sparse` (SparseAllGather / SparseReduceScatter with async handles), `relay` (their node-aware
forms: one copy per node crosses the network), `transfers` (the pure,
deterministic per-rank plan of who sends which rows and columns to whom), `streams` (the
dedicated communication stream on GPU, a no-op on CPU) and `traffic` (bytes per rank,
intra/inter-node), `exchange` (the one point-to-point row exchange the modes move experts,
state and gradient slices with). Imports `placement`; never `training` or the modes.
"""

from megatron_patches.comm.exchange import exchange
from megatron_patches.comm.groups import all_reduce_recorded, node_layout, ring_allreduce_numel
from megatron_patches.comm.relay import RelayAllGather, RelayReduceScatter
from megatron_patches.comm.sparse import CollectiveHandle, SparseAllGather, SparseReduceScatter
from megatron_patches.comm.streams import CommStream, comm_stream
from megatron_patches.comm.traffic import LinkBytes, TrafficCounter, default_counter
from megatron_patches.comm.transfers import Ownership, PeerTransfer, RankTransfers, plan_rank_transfers

__all__ = [
    "CollectiveHandle",
    "CommStream",
    "LinkBytes",
    "Ownership",
    "PeerTransfer",
    "RankTransfers",
    "RelayAllGather",
    "RelayReduceScatter",
    "SparseAllGather",
    "SparseReduceScatter",
    "TrafficCounter",
    "all_reduce_recorded",
    "comm_stream",
    "default_counter",
    "exchange",
    "node_layout",
    "plan_rank_transfers",
    "ring_allreduce_numel",
]
