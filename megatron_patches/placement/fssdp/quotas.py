"""The balanced token split of a replicated expert over its holders (`balanced_quotas`), used by
dispatch (DESIGN 4.4) and calibration (4.2 step 4)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from megatron_patches.placement import kernels
from megatron_patches.placement.fssdp.inputs import holdings
from megatron_patches.placement.types import PlacementError, check_loads

_QUOTA_MEMO: dict[bytes, np.ndarray] = {}
"""The last few `replicated_quotas` results, keyed by their inputs' bytes."""
_QUOTA_MEMO_SIZE = 4


class Holders(NamedTuple):
    """A placement's holders split into single-holder and replicated experts (`split_holders`)."""

    single_E: np.ndarray
    """Experts with exactly one holder; bool [E]."""
    holder_E: np.ndarray
    """Each expert's first (for a single-holder expert: only) holder, -1 where none; int64 [E]."""
    load_D: np.ndarray
    """Tokens of the single-holder experts at their holder; int64 [D]."""
    busy_D: np.ndarray
    """Single-holder experts with tokens per holder; int64 [D]."""
    rep: np.ndarray
    """The replicated experts, ascending; int64 [R]."""
    rep_ptr: np.ndarray
    """Where each replicated expert's holders start in `rep_dev`; int64 [R + 1]."""
    rep_dev: np.ndarray
    """The replicated experts' holders, ascending per expert; int64 [P]."""


def split_holders(holds_ED: np.ndarray, tokens_E: np.ndarray) -> Holders:
    """The holders of bool [E, D] holdings (`kernels.holder_lists`, `kernels.split_holders`)
    with the tokens `tokens_E` (int64 [E]) of the single-holder experts counted at theirs."""
    ptr, dev = kernels.holder_lists(np.ascontiguousarray(holds_ED))  # read as bytes: C order
    return Holders(*kernels.split_holders(ptr, dev, np.ascontiguousarray(tokens_E, dtype=np.int64), holds_ED.shape[1]))


def replicated_quotas(holders: Holders, tokens_E: np.ndarray) -> np.ndarray:
    """`balanced_quotas` of the replicated experts `holders.rep`; int64 [R, D], read-only.

    The quotas are a pure function of the replicated experts' holders, their tokens and the
    single-holder experts' loads, and the per-iteration planner asks for the same ones twice:
    `calibrate` prices its winning candidate with the quotas that `dispatch` then routes by
    (E = 64, D = 32: 0.1 ms of the planner's 1 ms per layer; tools/bench_planners.py). So the last
    `_QUOTA_MEMO_SIZE` results are kept, keyed by those inputs' bytes (a few us to build).
    """
    tokens_R = np.ascontiguousarray(tokens_E[holders.rep], dtype=np.int64)
    key = b"|".join(x.tobytes() for x in (holders.rep, holders.rep_ptr, holders.rep_dev, tokens_R, holders.load_D))
    quota_RD = _QUOTA_MEMO.get(key)
    if quota_RD is None:
        # water-filled heaviest first, then swept once more unless the first sweep reached the
        # lower bound on the peak, max(busiest device with single-holder experts only,
        # ceil(total / D)), which no second sweep can lower (kernels.replicated_quota_rows)
        quota_RD = kernels.replicated_quota_rows(holders.rep_ptr, holders.rep_dev, tokens_R, holders.load_D)
        quota_RD.setflags(write=False)
        if len(_QUOTA_MEMO) >= _QUOTA_MEMO_SIZE:
            del _QUOTA_MEMO[next(iter(_QUOTA_MEMO))]
        _QUOTA_MEMO[key] = quota_RD
    return quota_RD


def clear_quota_memo() -> None:
    """Forgets the memoized quotas (`replicated_quotas`): benchmarks call it before each timed
    call, so that repeating one call does not time a memo hit."""
    _QUOTA_MEMO.clear()


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
    holders = split_holders(holds_ED, tokens_E)
    missing = np.flatnonzero(holders.holder_E < 0)
    if missing.size:
        raise PlacementError(f"expert {int(missing[0])} has no holder; its tokens have nowhere to go")
    single = np.flatnonzero(holders.single_E)
    quota_ED = np.zeros(holds_ED.shape, dtype=np.int64)
    quota_ED[single, holders.holder_E[single]] = tokens_E[single]  # single holders take everything
    if holders.rep.size:
        quota_ED[holders.rep] = replicated_quotas(holders, tokens_E)
    return quota_ED
