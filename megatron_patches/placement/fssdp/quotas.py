"""The balanced token split of a replicated expert over its holders (`balanced_quotas`), used by
dispatch (DESIGN 4.4) and calibration (4.2 step 4)."""

from __future__ import annotations

import numpy as np

from megatron_patches.placement import kernels
from megatron_patches.placement.fssdp.inputs import holdings
from megatron_patches.placement.types import PlacementError, check_loads

_QUOTA_MEMO: dict[bytes, np.ndarray] = {}
"""The last few `replicated_quotas` results, keyed by their inputs' bytes."""
_QUOTA_MEMO_SIZE = 4


def replicated_quotas(ptr: np.ndarray, dev: np.ndarray, tokens_E: np.ndarray, load_D: np.ndarray,
                      rep: np.ndarray) -> np.ndarray:
    """`balanced_quotas` of the replicated experts `rep` (ascending); int64 [len(rep), D], read-only.

    The holders are in CSR form (`kernels.holder_lists`: expert e's holders dev[ptr[e]:ptr[e + 1]],
    ascending); `load_D` (int [D]) holds the tokens of the single-holder experts. The quotas are
    a pure function of the inputs, and the per-iteration planner asks for the same ones twice:
    `calibrate` prices its winning candidate with the quotas that `dispatch` then routes by
    (E = 64, D = 32: 0.1 ms of the planner's 1 ms per layer; tools/bench_planners.py). So the last
    `_QUOTA_MEMO_SIZE` results are kept, keyed by the inputs' bytes (the replicated experts'
    holder lists: a few us to build).
    """
    counts_E = np.diff(ptr)
    dev_P = dev[np.repeat(np.isin(np.arange(counts_E.size), rep), counts_E)]
    counts_R = counts_E[rep]
    key = b"|".join(
        np.ascontiguousarray(x, dtype=np.int64).tobytes() for x in (rep, counts_R, dev_P, tokens_E[rep], load_D)
    )
    quota_RD = _QUOTA_MEMO.get(key)
    if quota_RD is None:
        quota_RD = _sweep_quotas(counts_R, dev_P, tokens_E[rep], load_D)
        quota_RD.setflags(write=False)
        if len(_QUOTA_MEMO) >= _QUOTA_MEMO_SIZE:
            del _QUOTA_MEMO[next(iter(_QUOTA_MEMO))]
        _QUOTA_MEMO[key] = quota_RD
    return quota_RD


def clear_quota_memo() -> None:
    """Forgets the memoized quotas (`replicated_quotas`): benchmarks call it before each timed
    call, so that repeating one call does not time a memo hit."""
    _QUOTA_MEMO.clear()


def _sweep_quotas(counts_R: np.ndarray, dev_P: np.ndarray, tokens_R: np.ndarray, load_D: np.ndarray) -> np.ndarray:
    """`replicated_quotas` without the memo, of the replicated experts' holder lists (counts_R
    holders each, their devices dev_P one expert after the other): water-fills
    (`kernels.fill_sorted`) the replicated experts heaviest first, then sweeps once more. The
    second sweep is skipped when the first already reaches the lower bound on the peak,
    max(busiest device with single-holder experts only, ceil(total / D)): it cannot lower the
    peak then."""
    R = counts_R.size
    holder_ptr = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(counts_R, out=holder_ptr[1:])
    tokens_R = np.ascontiguousarray(tokens_R, dtype=np.int64)
    load_D = np.ascontiguousarray(load_D, dtype=np.int64)
    D = load_D.size
    bound = max(int(load_D.max()), -(-(int(load_D.sum()) + int(tokens_R.sum())) // D))
    order_R = np.argsort(-tokens_R, kind="stable")  # heaviest first, ties: lower id
    quota_P = kernels.sweep_quotas(holder_ptr, np.ascontiguousarray(dev_P, dtype=np.int64), tokens_R, load_D,
                                   order_R, bound)
    quota_RD = np.zeros((R, D), dtype=np.int64)
    quota_RD[np.repeat(np.arange(R), counts_R), dev_P] = quota_P
    return quota_RD


def balanced_quotas(holds_ED, tokens_E) -> np.ndarray:
    """Tokens each holder of each expert should process so that device loads even out; int64 [E, D].

    An expert with one holder sends it everything. The tokens of a replicated expert are
    water-filled over its holders (`kernels.fill_sorted`): the least-loaded holders, counting what they
    already process for other experts, are topped up to a common level. Replicated experts go
    heaviest first (ties: lower id), and a second sweep refills each of them with the others'
    quotas fixed, which undoes most of the first sweep's order effects (unless the first
    already reached the lower bound on the peak; docs/benchmarks.md, "Balanced quotas").

    Args:
        holds_ED: which device holds which expert, bool or int [E, D]; every expert >= 1 holder.
        tokens_E: tokens routed to each expert, int [E], >= 0.
    Returns:
        quota_ED with quota_ED[e, d] > 0 only where d holds e and rows summing to tokens_E.
    """
    holds_ED = holdings(holds_ED)
    tokens_E = check_loads(tokens_E, "tokens_E", 1)
    if holds_ED.ndim != 2 or tokens_E.size != holds_ED.shape[0]:
        raise PlacementError(
            f"tokens_E has {tokens_E.size} entries but holds_ED has shape {holds_ED.shape}; need [E, D] and [E]"
        )
    ptr, dev = kernels.holder_lists(holds_ED)
    replicas_E = np.diff(ptr)
    missing = np.flatnonzero(replicas_E == 0)
    if missing.size:
        raise PlacementError(f"expert {int(missing[0])} has no holder; its tokens have nowhere to go")
    E, D = holds_ED.shape
    single = np.flatnonzero(replicas_E == 1)
    holder_S = dev[ptr[single]]
    quota_ED = np.zeros((E, D), dtype=np.int64)
    quota_ED[single, holder_S] = tokens_E[single]  # single holders take everything
    rep = np.flatnonzero(replicas_E > 1)
    if rep.size:
        load_D = np.bincount(holder_S, weights=tokens_E[single], minlength=D).astype(np.int64)
        quota_ED[rep] = replicated_quotas(ptr, dev, tokens_E, load_D, rep)
    return quota_ED
