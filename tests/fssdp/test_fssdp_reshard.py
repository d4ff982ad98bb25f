"""FSSDP heterogeneous re-sharding: moving experts' weights and optimizer state between ranks.

Two levels here:
- `plan_reshard` (pure planning): every changed expert leaves its old owner and arrives at its
  new one, senders and receivers agree on the order, experts that stay keep their slot;
- `exchange_slots` on 4 gloo ranks: after two successive re-shards every slot holds exactly
  the content of the (layer, expert) its table names, and the bytes are moved x row bytes.
End to end (training re-shards on real text, equals ep's losses, counts the bytes, owners become
heterogeneous per layer, a checkpoint saved after a re-shard resumes in fssdp bit for bit with the
same decisions, in ep, in replicate, and at another world size) is tests/training/test_composition.py's.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist


from support.mp import run_ranks

from megatron_patches.comm.traffic import TrafficCounter
from megatron_patches.fssdp.reshard import SlotTable, exchange_slots, plan_reshard
from megatron_patches.placement.types import ModelShardLayout, Topology

LAYERS, EXPERTS, RANKS = 3, 8, 4


def random_layout(rng, num_layers: int, num_experts: int, num_devices: int) -> ModelShardLayout:
    """Every device owns L*E/D experts in all, any number of one layer."""
    owners = np.repeat(np.arange(num_devices), num_layers * num_experts // num_devices)
    return ModelShardLayout(rng.permutation(owners).reshape(num_layers, num_experts), num_devices)


# ---- planning ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_plan_moves_every_changed_expert_once_in_matching_order(seed):
    rng = np.random.default_rng(seed)
    even = ModelShardLayout.even(LAYERS, EXPERTS, RANKS)
    tables = {rank: SlotTable.identity(LAYERS, EXPERTS, RANKS, rank) for rank in range(RANKS)}
    current = even
    for _ in range(2):  # from the identity table, then from a shuffled one
        proposed = random_layout(rng, LAYERS, EXPERTS, RANKS)
        moves = {rank: plan_reshard(tables[rank], current, proposed, rank) for rank in range(RANKS)}
        changed = {tuple(x) for x in np.argwhere(current.owners_LE != proposed.owners_LE)}
        assert {m.moved for m in moves.values()} == {len(changed)}
        arrived = set()
        for rank, m in moves.items():
            for peer, slots in m.send:
                sent = [tuple(tables[rank].held_S2[s]) for s in slots]
                assert all(current.owners_LE[x] == rank and proposed.owners_LE[x] == peer for x in sent)
                # the receiver fills its slots with the same experts in the same order
                recv = dict(moves[peer].recv)[rank]
                assert [tuple(moves[peer].table.held_S2[s]) for s in recv] == sent
                arrived.update(sent)
            # experts that stay keep their slot
            stays = [s for s, x in enumerate(tables[rank].held_S2) if proposed.owners_LE[tuple(x)] == rank]
            assert np.array_equal(m.table.held_S2[stays], tables[rank].held_S2[stays])
            m.table.check(proposed, rank)
        assert arrived == changed
        tables = {rank: m.table for rank, m in moves.items()}
        current = proposed


def test_plan_refuses_unbalanced_layouts_and_stale_tables():
    even = ModelShardLayout.even(LAYERS, EXPERTS, RANKS)
    identity = SlotTable.identity(LAYERS, EXPERTS, RANKS, 0)
    unbalanced = even.owners_LE.copy()
    unbalanced[0, 0] = 1  # rank 0 gives an expert away and gets none back
    with pytest.raises(ValueError, match=r"experts per rank must stay \[6, 6, 6, 6\]"):
        plan_reshard(identity, even, ModelShardLayout(unbalanced, RANKS), 0)
    shuffled = random_layout(np.random.default_rng(0), LAYERS, EXPERTS, RANKS)
    with pytest.raises(ValueError, match="rank 0: the slots hold"):
        plan_reshard(identity, shuffled, even, 0)
    with pytest.raises(ValueError, match="do not split evenly"):
        SlotTable.identity(LAYERS, 6, RANKS, 0)


# ---- the exchange on 4 gloo ranks -------------------------------------------------------

NUMEL = (5, 3)
"""Elements of a slot's two parameters."""


def code(layer: int, expert: int) -> float:
    return 10.0 * layer + expert  # exact in bf16 for these sizes


def slot_content(table: SlotTable, slot: int) -> list[torch.Tensor]:
    """Weights fp32 and bf16, an fp32 moment per weight: distinct values per (layer, expert)."""
    layer, expert = (int(v) for v in table.held_S2[slot])
    c = code(layer, expert)
    return [
        torch.full((NUMEL[0],), c), torch.full((NUMEL[0],), c + 0.5),
        torch.full((NUMEL[1],), c, dtype=torch.bfloat16), torch.full((NUMEL[1],), -c),
    ]


def exchange_checks() -> dict:
    rank = dist.get_rank()
    group = dist.group.WORLD
    topology = Topology.single_node(RANKS)
    rng = np.random.default_rng(7)
    current = ModelShardLayout.even(LAYERS, EXPERTS, RANKS)
    table = SlotTable.identity(LAYERS, EXPERTS, RANKS, rank)
    slots = [slot_content(table, s) for s in range(table.held_S2.shape[0])]
    row_bytes = sum(t.numel() * t.element_size() for t in slots[0])
    report = {"moved": [], "sent": [], "received": [], "row_bytes": row_bytes}
    for _ in range(2):
        proposed = random_layout(rng, LAYERS, EXPERTS, RANKS)
        traffic = TrafficCounter()
        moves = plan_reshard(table, current, proposed, rank)
        exchange_slots(moves, lambda s: slots[s], group, topology, traffic)
        table, current = moves.table, proposed
        for s, tensors in enumerate(slots):
            expected = slot_content(table, s)
            assert all(torch.equal(a, b) for a, b in zip(tensors, expected)), (rank, s, table.held_S2[s])
        report["moved"].append(moves.moved)
        report["sent"].append(traffic.get("reshard").sent)
        report["received"].append(traffic.get("reshard").received)
    return report


@pytest.mark.multirank
def test_exchange_moves_slot_contents_on_gloo_ranks():
    reports = run_ranks(RANKS, __file__, "exchange_checks", timeout=180)
    row_bytes = reports[0]["row_bytes"]
    assert row_bytes == 2 * NUMEL[0] * 4 + NUMEL[1] * (2 + 4)
    for step in range(2):
        moved = reports[0]["moved"][step]
        assert moved > 0 and all(r["moved"][step] == moved for r in reports)
        assert sum(r["sent"][step] for r in reports) == sum(r["received"][step] for r in reports) == moved * row_bytes
