"""FSSDP heterogeneous re-sharding: moving experts' weights and optimizer state between ranks.

Three levels:
- `plan_reshard` (pure planning): every changed expert leaves its old owner and arrives at its
  new one, senders and receivers agree on the order, experts that stay keep their slot;
- `exchange_slots` on 4 gloo ranks: after two successive re-shards every slot holds exactly
  the content of the (layer, expert) its table names, and the bytes are moved x row bytes;
- end to end through `pretrain_gpt_moe.py` on 4 gloo ranks: with a small overlap degree the
  router's own skew on real text makes re-sharding move experts, and the losses still equal
  ep's (fp32, no dropping); the logged re-shard bytes are moved experts x (weights + Adam's
  two moments); a checkpoint saved after a re-shard resumes in ep mode on ep's losses, and in
  fssdp mode with the re-sharded layout and the load history: the uninterrupted run's losses,
  placements and re-shard decisions exactly.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist


from support.mp import run_ranks
from support.training import launch

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


# ---- end to end ---------------------------------------------------------------------------

ITERS = 16
INTERVAL = 4
SAVE_AT = 10
COMMON = [
    "--expert-model-parallel-size", "4", "--lr-warmup-iters", "5", "--lr-decay-iters", str(ITERS),
    "--log-interval", "1", "--eval-interval", "1000", "--hidden-dropout", "0", "--attention-dropout", "0",
]
# tiny: 2 MoE layers of 8 experts, fc1 64x128 + 128, fc2 128x64 + 64 (fp32); the fp32 Adam
# state is exp_avg and exp_avg_sq, no separate main copy.
EXPERT_BYTES = 16_576 * 4
MOVED_BYTES_PER_EXPERT = 3 * EXPERT_BYTES
TINY_LAYERS, TINY_EXPERTS = 2, 8
# t = m = 1: one copy of the hottest expert per layer, so who owns the others matters and
# the heterogeneous layout lowers the imbalance bound.
FSSDP = ["--moe-parallel-mode", "fssdp", "--fssdp-overlap-degree", "1", "--fssdp-memory-capacity", "1",
         "--fssdp-reshard-interval", str(INTERVAL)]


@pytest.mark.e2e
def test_reshard_matches_ep_counts_bytes_and_resumes_in_ep_and_fssdp(tmp_path):
    ep = launch(4, [*COMMON, "--train-iters", str(ITERS)], tmp_path, "ep")
    ckpt = tmp_path / "ckpt"
    fssdp = launch(4, [*COMMON, "--train-iters", str(ITERS), *FSSDP, "--save", str(ckpt), "--save-interval", str(SAVE_AT)],
                   tmp_path, "fssdp")

    # (1) the same model: re-sharding only changes where experts and their state live
    losses = [r["loss"] for r in fssdp.records if "loss" in r]
    assert len(losses) == ITERS
    np.testing.assert_allclose(losses, [r["loss"] for r in ep.records if "loss" in r], rtol=1e-5, atol=0)

    # (2) checks at every INTERVAL iterations, bytes = moved x (weights + exp_avg + exp_avg_sq)
    checks = [r["fssdp"]["reshard"] for r in fssdp.records if "loss" in r and r["fssdp"]["reshard"] is not None]
    assert [c["iteration"] for c in checks] == list(range(INTERVAL + 1, ITERS + 1, INTERVAL))
    adopted = [c for c in checks if c["adopted"]]
    assert adopted and all(c["moved"] > 0 and c["bound_proposed"] < c["bound_before"] for c in adopted)
    heterogeneous = False
    for record in fssdp.records:
        if "loss" not in record:
            continue
        info = record["fssdp"]
        moved = info["reshard"]["moved"] if info["reshard"] else 0
        assert info["bytes"]["reshard"] == {"intra": moved * MOVED_BYTES_PER_EXPERT, "inter": 0}
        owned_LD = np.array([layer["owned"] for layer in info["layers"]])
        # memory stays balanced over the layers, not per layer
        assert owned_LD.sum(axis=0).tolist() == [TINY_LAYERS * TINY_EXPERTS // 4] * 4
        heterogeneous |= len(np.unique(owned_LD)) > 1
        memory = info["memory"]
        assert sum(memory["optimizer_state_bytes"]) == 2 * TINY_LAYERS * TINY_EXPERTS * EXPERT_BYTES
        assert len(set(memory["optimizer_state_bytes"])) == 1
    assert heterogeneous, "no re-shard gave a rank more experts of one layer than of another"
    assert f"fssdp: re-shard at iteration {adopted[0]['iteration']}: moved {adopted[0]['moved']} experts" in fssdp.output

    # (3) saved after a re-shard, resumed in ep mode: ep's own continuation
    assert adopted[0]["iteration"] <= SAVE_AT
    (ckpt / "latest_checkpointed_iteration.txt").write_text(f"{SAVE_AT}\n")  # the mid-run save
    resumed = launch(4, [*COMMON, "--train-iters", str(ITERS), "--load", str(ckpt)], tmp_path, "ep_resumed")
    assert resumed.records[0]["iteration"] == SAVE_AT + 1
    np.testing.assert_allclose(
        [r["loss"] for r in resumed.records if "loss" in r],
        [r["loss"] for r in ep.records if "loss" in r][SAVE_AT:], rtol=1e-5, atol=0,
    )

    # (4) resumed in fssdp: the saved layout (after the re-shard), slot tables and load history
    fssdp_resumed = launch(4, [*COMMON, "--train-iters", str(ITERS), *FSSDP, "--load", str(ckpt)], tmp_path,
                           "fssdp_resumed")
    assert "fssdp: restored the shard layout" in fssdp_resumed.output
    assert "10 observed iterations of loads" in fssdp_resumed.output
    straight = [r for r in fssdp.records if "loss" in r][SAVE_AT:]
    again = [r for r in fssdp_resumed.records if "loss" in r]
    assert [r["loss"] for r in again] == [r["loss"] for r in straight]
    assert [r["grad_norm"] for r in again] == [r["grad_norm"] for r in straight]
    for record, reference in zip(again, straight):
        assert [layer["owned"] for layer in record["fssdp"]["layers"]] == [
            layer["owned"] for layer in reference["fssdp"]["layers"]]
        assert [layer["copies"] for layer in record["fssdp"]["layers"]] == [
            layer["copies"] for layer in reference["fssdp"]["layers"]]
        assert record["fssdp"]["reshard"] == reference["fssdp"]["reshard"]
