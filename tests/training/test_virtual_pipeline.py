"""The data side of virtual pipeline stages: Megatron's interleaved schedule calls each model
chunk's forward step with that chunk's own iterator (`datasets.chunk_iterators`)."""

from __future__ import annotations

import pytest

from megatron_patches.data.datasets import chunk_iterators


class Counting:
    """Micro-batches 0, 1, 2, ... and how many were read."""

    def __init__(self):
        self.reads = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.reads += 1
        return {"index": self.reads - 1}


def test_every_chunk_sees_every_micro_batch_in_order_each_read_once():
    source = Counting()
    chunk0, chunk1 = chunk_iterators(source, 2)
    # the interleaved order of PP 2 x VP 2 with 4 micro-batches on the first stage: chunk 0 runs
    # micro-batches 0-1, chunk 1 runs 0-1, chunk 0 runs 2-3 ...
    seen = [next(chunk0), next(chunk0), next(chunk1), next(chunk1), next(chunk0), next(chunk0), next(chunk1), next(chunk1)]
    assert [batch["index"] for batch in seen] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert source.reads == 4
    assert seen[0] is seen[2]  # the same micro-batch, not a second read of the dataset
    assert not chunk0.shared.pending  # every micro-batch dropped once both chunks had it


def test_a_chunk_may_run_ahead():
    source = Counting()
    chunks = chunk_iterators(source, 3)
    ahead = [next(chunks[2])["index"] for _ in range(3)]
    assert ahead == [0, 1, 2] and source.reads == 3
    assert [next(chunks[0])["index"] for _ in range(4)] == [0, 1, 2, 3]
    assert source.reads == 4
    assert sorted(chunks[0].shared.pending) == [0, 1, 2, 3]  # chunk 1 has read none yet


def test_the_source_running_out_ends_every_chunk():
    chunk0, chunk1 = chunk_iterators(iter([{"index": 0}]), 2)
    assert next(chunk0) == next(chunk1) == {"index": 0}
    with pytest.raises(StopIteration):
        next(chunk1)


def test_a_key_marked_for_another_chunk_loads_into_that_chunk():
    """fssdp keeps a layer's expert in any slot module of its rank, with virtual stages one of
    another chunk: its entry in this chunk's state dict names that chunk (`mcore.in_chunk`)."""
    import torch

    from megatron_patches.compat import mcore

    chunks = [torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False)]
    loaded = {
        "model0": {},
        "model1": {mcore.in_chunk(0, "weight"): torch.full((2, 2), 3.0), "weight": torch.full((2, 2), 2.0)},
        "other": 5,
    }
    mcore.load_model_state(chunks, loaded)
    assert chunks[0].weight.eq(3.0).all() and chunks[1].weight.eq(2.0).all()
    assert loaded == {"other": 5}  # the model's entries are taken out
