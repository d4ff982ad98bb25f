"""The balanced token split of a replicated expert over its holders (`balanced_quotas`), used by
dispatch (DESIGN 4.4) and calibration (4.2 step 4)."""

from __future__ import annotations

import numpy as np

from megatron_patches.placement import kernels
from megatron_patches.placement.types import PlacementError, check_loads


def fill_holders(load_H: list, tokens: int) -> list:
    """Water-fill `tokens` over holders with integer loads load_H; integer quotas, same order.

    The least-loaded holders are raised to a common level: with the loads sorted ascending
    (s_0 <= s_1 <= ..., ties by position), the first j+1 holders are filled, j the smallest
    index with tokens + s_0 + ... + s_j <= (j+1) * s_{j+1}. Each filled holder gets
    floor(level) - load, and the level's remainder goes one token each to the first filled
    holders in that order. Integer arithmetic, so the quotas sum to `tokens` exactly.

    Plain Python on lists: the fills run one after another, and at the holder counts that
    occur (tens to a thousand) this beats numpy's per-call overhead at the small end (4 vs 9 us
    for 16 holders) and costs 0.12 ms at 1024.
    """
    order = sorted(range(len(load_H)), key=load_H.__getitem__)
    last = len(order) - 1
    total = tokens
    for j, h in enumerate(order):
        total += load_H[h]
        if j == last or total <= load_H[order[j + 1]] * (j + 1):
            break
    level, rem = divmod(total, j + 1)
    quota = [0] * len(load_H)
    for i in range(j + 1):
        h = order[i]
        quota[h] = level - load_H[h] + (i < rem)
    return quota


FILL_IN_NUMPY = 48
"""Holder counts above which `fill_holders_array` water-fills with numpy instead of lists: the
two agree exactly; numpy's fixed cost per call is paid back from about this many holders."""


def fill_holders_array(load_H: np.ndarray, tokens: int) -> np.ndarray:
    """`fill_holders` of an int64 array; int64 quotas, the same values."""
    if load_H.size <= FILL_IN_NUMPY:
        return np.array(fill_holders(load_H.tolist(), tokens), dtype=np.int64)
    order = np.argsort(load_H, kind="stable")  # ascending, ties by position, as sorted() orders them
    sorted_H = load_H[order]
    total_H = np.cumsum(sorted_H) + tokens  # tokens + s_0 + ... + s_j
    stops = np.flatnonzero(total_H[:-1] <= sorted_H[1:] * np.arange(1, sorted_H.size))
    j = int(stops[0]) if stops.size else sorted_H.size - 1
    level, rem = divmod(int(total_H[j]), j + 1)
    quota_H = np.zeros(sorted_H.size, dtype=np.int64)
    quota_H[order[: j + 1]] = level - sorted_H[: j + 1] + (np.arange(j + 1) < rem)
    return quota_H


_QUOTA_MEMO: dict[bytes, np.ndarray] = {}
"""The last few `replicated_quotas` results, keyed by their inputs' bytes."""
_QUOTA_MEMO_SIZE = 4


def replicated_quotas(holds_ED: np.ndarray, tokens_E: np.ndarray, load_D: np.ndarray, rep: np.ndarray) -> np.ndarray:
    """`balanced_quotas` of the replicated experts `rep`; int64 [len(rep), D], read-only.

    `load_D` (int [D]) holds the tokens of the single-holder experts. The quotas are a pure
    function of the inputs, and the per-iteration planner asks for the same ones twice:
    `calibrate` prices its winning candidate with the quotas that `dispatch` then routes by
    (E = 64, D = 32: 0.1 ms of the planner's 1 ms per layer; tools/bench_planners.py). So the last
    `_QUOTA_MEMO_SIZE` results are kept, keyed by the inputs' bytes (a few us to build).
    """
    key = b"|".join(
        np.ascontiguousarray(x, dtype=dtype).tobytes()
        for x, dtype in ((rep, np.int64), (holds_ED[rep], bool), (tokens_E[rep], np.int64), (load_D, np.int64))
    )
    quota_RD = _QUOTA_MEMO.get(key)
    if quota_RD is None:
        quota_RD = _sweep_quotas(holds_ED, tokens_E, load_D, rep)
        quota_RD.setflags(write=False)
        if len(_QUOTA_MEMO) >= _QUOTA_MEMO_SIZE:
            del _QUOTA_MEMO[next(iter(_QUOTA_MEMO))]
        _QUOTA_MEMO[key] = quota_RD
    return quota_RD


def clear_quota_memo() -> None:
    """Forgets the memoized quotas (`replicated_quotas`): benchmarks call it before each timed
    call, so that repeating one call does not time a memo hit."""
    _QUOTA_MEMO.clear()


def _sweep_quotas(holds_ED: np.ndarray, tokens_E: np.ndarray, load_D: np.ndarray, rep: np.ndarray) -> np.ndarray:
    """`replicated_quotas` without the memo: water-fills (`fill_holders`) the replicated experts
    heaviest first, then sweeps once more. The second sweep is skipped when the first already
    reaches the lower bound on the peak, max(busiest device with single-holder experts only,
    ceil(total / D)): it cannot lower the peak then."""
    rows_P, devices_P = np.nonzero(holds_ED[rep])  # (replicated expert, holder) pairs, row-major
    holder_ptr = np.zeros(rep.size + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows_P, minlength=rep.size), out=holder_ptr[1:])
    tokens_R = np.ascontiguousarray(tokens_E[rep], dtype=np.int64)
    load_D = np.ascontiguousarray(load_D, dtype=np.int64)
    D = load_D.size
    bound = max(int(load_D.max()), -(-(int(load_D.sum()) + int(tokens_R.sum())) // D))
    order_R = np.argsort(-tokens_R, kind="stable")  # heaviest first, ties: lower id
    quota_P = kernels.sweep_quotas(holder_ptr, devices_P.astype(np.int64), tokens_R, load_D, order_R, bound)
    quota_RD = np.zeros((rep.size, D), dtype=np.int64)
    quota_RD[rows_P, devices_P] = quota_P
    return quota_RD


def balanced_quotas(holds_ED, tokens_E) -> np.ndarray:
    """Tokens each holder of each expert should process so that device loads even out; int64 [E, D].

    An expert with one holder sends it everything. The tokens of a replicated expert are
    water-filled over its holders (`fill_holders`): the least-loaded holders, counting what they
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
    holds_ED = np.asarray(holds_ED) > 0
    tokens_E = check_loads(tokens_E, "tokens_E", 1)
    if holds_ED.ndim != 2 or tokens_E.size != holds_ED.shape[0]:
        raise PlacementError(
            f"tokens_E has {tokens_E.size} entries but holds_ED has shape {holds_ED.shape}; need [E, D] and [E]"
        )
    replicas_E = holds_ED.sum(axis=1)
    missing = np.flatnonzero(replicas_E == 0)
    if missing.size:
        raise PlacementError(f"expert {int(missing[0])} has no holder; its tokens have nowhere to go")
    quota_ED = holds_ED * tokens_E[:, None]  # single holders take everything
    rep = np.flatnonzero(replicas_E > 1)
    quota_ED[rep] = 0
    quota_ED[rep] = replicated_quotas(holds_ED, tokens_E, quota_ED.sum(axis=0), rep)
    return quota_ED
