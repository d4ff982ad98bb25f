"""Compiled inner loops of the placement engine (issue 44: plan a layer of E = 256 experts over
D = 1,024 devices in milliseconds, and simulate such runs).

The planners' steps are sequences of small dependent decisions: water-fill one expert's tokens
over its holders given what the previous experts left, match one node's sources to its holders
with two pointers, give a receiver's arrivals their room in source order. In numpy each
decision costs a few calls of fixed overhead over arrays of tens of entries, or several passes
over a quarter-million-entry array to express one walk (E = 256, D = 1,024: dispatch took 18
ms, 11 of them in that walk). Compiled by numba, these loops take microseconds to a few
milliseconds. The modules that call them keep the semantics and the docstrings. Every kernel
replaced numpy code and reproduces its results exactly, including the order of float sums:
tests/placement/test_planner_golden.py pins 165 FSSDP plans byte for byte, and the token
spread of replicate was compared entry for entry on 96 random cases (the brute-force tests in
tests/placement/test_replicate.py keep checking it).

Compiled on first use and cached next to this file (`cache=True`; numba's user cache where the
install is read-only; `_jit`): one process compiles (about 7 s for all of them on a 2-core VM),
every later one loads the machine code in milliseconds.
A helper called once per element of a hot loop (`add_link`) costs nothing measurable (1 M
transfers: 2.44 ms against 2.49 written out); one written with `inline="always"` and an early
return made such a loop 20 times slower.
"""

from __future__ import annotations

import heapq
import sys

import numba
import numpy as np

_UNCACHED: list[str] = []
"""Kernels compiled without a cache, because no cache directory was writable."""


def _jit(func):
    """numba.njit with the machine code cached (`cache=True`) beside this file or, where the
    install is read-only, in numba's user cache (~/.cache/numba). Where neither is writable numba
    refuses to cache: the kernels are then compiled in every process, and the first of them
    says so on stderr with the way out (NUMBA_CACHE_DIR), rather than failing the import."""
    try:
        return numba.njit(cache=True, nogil=True)(func)
    except RuntimeError as error:  # numba's "cannot cache function ...: no locator available"
        if not _UNCACHED:
            print(f"megatron_patches: the placement planner's compiled kernels cannot be cached ({error}); they are "
                  "compiled in every process instead (seconds at start-up). Set NUMBA_CACHE_DIR to a writable "
                  "directory to cache them.", file=sys.stderr)
        _UNCACHED.append(func.__name__)
        return numba.njit(nogil=True)(func)


@_jit
def _stable_order(load_H, order_H):
    """Writes into order_H (int64 [>= 2 H]) the positions of load_H by ascending load, ties by
    position (a stable sort), without allocating: insertion sort for the few holders of most
    experts; beyond 32, a sort of the keys (load - least) x H + position (distinct, so any sort
    is stable), 3x numba's merge sort at 1,024 holders (an expert copied everywhere)."""
    H = load_H.size
    if H > 32:
        least = load_H.min()
        keys = order_H[H : 2 * H]
        for i in range(H):
            keys[i] = (load_H[i] - least) * H + i
        keys.sort()
        for i in range(H):
            order_H[i] = keys[i] % H
        return
    for i in range(H):
        order_H[i] = i
    _sort_by_load(order_H, H, load_H)


@_jit
def _fill(load_H, tokens, quota_H, order_H):
    """`fill_sorted` with a caller's buffer for the order (int64 [>= 2 H])."""
    H = load_H.size
    _stable_order(load_H, order_H)
    total = tokens
    j = 0
    while True:
        total += load_H[order_H[j]]
        if j == H - 1 or total <= load_H[order_H[j + 1]] * (j + 1):
            break
        j += 1
    level = total // (j + 1)
    rem = total - level * (j + 1)
    quota_H[:] = 0
    for i in range(j + 1):
        h = order_H[i]
        quota_H[h] = level - load_H[h] + (1 if i < rem else 0)


@_jit
def fill_sorted(load_H, tokens, quota_H):
    """Water-fill `tokens` over holders with integer loads load_H (int64 [H]) into quota_H
    (int64 [H], overwritten).

    The least-loaded holders are raised to a common level: with the loads sorted ascending
    (s_0 <= s_1 <= ..., ties by position), the first j+1 holders are filled, j the smallest
    index with tokens + s_0 + ... + s_j <= (j+1) * s_{j+1}. Each filled holder gets
    floor(level) - load, and the level's remainder goes one token each to the first filled
    holders in that order. Integer arithmetic, so the quotas sum to `tokens` exactly."""
    _fill(load_H, tokens, quota_H, np.empty(2 * load_H.size, dtype=np.int64))


@_jit
def sweep_quotas(holder_ptr, holder_dev, tokens_R, load_D, order_R, bound):
    """The water-fill sweeps of `quotas.replicated_quotas` over holder lists in CSR form (expert
    r's holders are holder_dev[holder_ptr[r]:holder_ptr[r + 1]], ascending); returns each holder's quota in
    the same layout (int64 [P]). `order_R` is the fill order (heaviest first) and `bound` the
    lower bound on the peak below which the second sweep cannot help. One pair of buffers
    serves every expert's fill."""
    load = load_D.copy()
    quota_P = np.zeros(holder_dev.size, dtype=np.int64)
    most = 0
    for r in range(order_R.size):
        most = max(most, holder_ptr[r + 1] - holder_ptr[r])
    load_buffer = np.empty(most, dtype=np.int64)
    order_buffer = np.empty(2 * most, dtype=np.int64)
    for sweep in range(2):
        if sweep == 1 and load.max() <= bound:
            break
        for k in range(order_R.size):
            r = order_R[k]
            lo, hi = holder_ptr[r], holder_ptr[r + 1]
            load_H = load_buffer[: hi - lo]
            for i in range(hi - lo):
                load_H[i] = load[holder_dev[lo + i]] - quota_P[lo + i]
            _fill(load_H, tokens_R[r], quota_P[lo:hi], order_buffer)
            for i in range(hi - lo):
                load[holder_dev[lo + i]] = load_H[i] + quota_P[lo + i]
    return quota_P


@_jit
def add_link(out, node_of, source, dest, amount):
    """Adds a transfer of `amount` from `source` to `dest` (different devices) to `out` ([4, D]
    rows: sent within the node, sent to other nodes, received within the node, from other
    nodes): the one link-class rule of every byte and token sum here."""
    link = 0 if node_of[source] == node_of[dest] else 1
    out[link, source] += amount
    out[link + 2, dest] += amount


@_jit
def _next_match(supply, capacity, a, b, hi):
    """The next pair of the north-west walk below `hi`: the first source from a with supply left
    and the first device from b with room left (either is hi when none is left)."""
    while a < hi and supply[a] == 0:
        a += 1
    while b < hi and capacity[b] == 0:
        b += 1
    return a, b


@_jit
def _route(loads_SE, rep, quota_RD, node_start, out, only_source):
    """`route_replicated`'s walk. Writes the pieces into `out` (int64 [4, K]) unless it has no
    columns, only those from `only_source` when that is >= 0. Returns the number of pieces it
    writes or would write."""
    R, D = quota_RD.shape
    write = out.shape[1] > 0
    k = 0
    supply = np.empty(D, dtype=np.int64)
    capacity = np.empty(D, dtype=np.int64)
    for r in range(R):
        e = rep[r]
        for d in range(D):
            tokens = loads_SE[d, e]
            kept = min(tokens, quota_RD[r, d])
            supply[d] = tokens - kept
            capacity[d] = quota_RD[r, d] - kept
            if kept > 0 and (only_source < 0 or d == only_source):
                if write:
                    out[0, k], out[1, k], out[2, k], out[3, k] = d, e, d, kept
                k += 1
        for n in range(node_start.size):  # the nodes, then (n = last + 1) all devices at once
            lo = node_start[n] if n < node_start.size - 1 else 0
            hi = node_start[n + 1] if n < node_start.size - 1 else D
            a, b = lo, lo
            while True:
                a, b = _next_match(supply, capacity, a, b, hi)
                if a == hi or b == hi:
                    break
                amount = min(supply[a], capacity[b])
                if only_source < 0 or a == only_source:
                    if write:
                        out[0, k], out[1, k], out[2, k], out[3, k] = a, e, b, amount
                    k += 1
                supply[a] -= amount
                capacity[b] -= amount
    return k


@_jit
def route_replicated(loads_SE, rep, quota_RD, node_start, only_source):
    """The pieces of `dispatch.dispatch` for the replicated experts `rep`, given their quotas
    quota_RD (int64 [R, D]); devices are numbered node-major, node n spanning
    node_start[n]:node_start[n + 1]. With only_source >= 0, only that source's pieces.

    Per expert: each source keeps up to its quota of its own tokens; then, node by node,
    sources in ascending id fill the node's holders' remaining quotas in ascending id (two
    pointers: the north-west corner rule); then what is left is matched the same way across
    all devices. Returns int64 [4, K]: source, expert, destination, tokens of each piece.

    Walks twice, counting and then writing: a worst-case buffer and a trimmed copy cost more
    (each fresh megabyte is page faults; K is about R x D pieces).
    """
    none = np.empty((4, 0), dtype=np.int64)
    out = np.empty((4, _route(loads_SE, rep, quota_RD, node_start, none, only_source)), dtype=np.int64)
    _route(loads_SE, rep, quota_RD, node_start, out, only_source)
    return out


@_jit
def owner_link_tokens(loads_SE, sent_S, dest_E, grid_E, tokens_E, rep, quota_RD, node_start, node_of):
    """`DispatchPlan.link_tokens` of a `by_owner` plan (rows as `add_link`), without walking
    every source of every expert; int64 [4, D] (S = D). `sent_S` is loads_SE's row sums.

    What a source does not keep it sends, within its node or to other nodes, so only the
    within-node parts need a walk: a grid expert's sources on its holder's node, and a
    replicated expert's `route_replicated` walk on the nodes where it has a quota. Its walk
    across all devices moves nothing within a node: when a node's own walk ends, the node has
    no supply left or no room left. Every device's room (its quotas less what it keeps) is
    filled, so what it receives from other nodes is its room less what its node sent it. A
    node without a quota of the expert keeps none of its tokens. So the cost is a node's
    devices per (expert, holding node), not S per expert (E = 256, D = 1,024: 1.5 ms
    before)."""
    S, E = loads_SE.shape
    D = node_of.size
    out = np.zeros((4, D), dtype=np.int64)
    kept_S = np.zeros(S, dtype=np.int64)
    received_D = np.zeros(D, dtype=np.int64)  # from other devices, within the node or not
    for e in range(E):
        if not grid_E[e]:
            continue
        dest = dest_E[e]
        n = node_of[dest]
        same = 0
        for a in range(node_start[n], node_start[n + 1]):
            if a == dest:
                kept_S[a] += loads_SE[a, e]
            else:
                out[0, a] += loads_SE[a, e]
                same += loads_SE[a, e]
        out[2, dest] += same
        received_D[dest] += tokens_E[e] - loads_SE[dest, e]
    supply = np.empty(D, dtype=np.int64)
    capacity = np.empty(D, dtype=np.int64)
    for r in range(rep.size):
        e = rep[r]
        for n in range(node_start.size - 1):
            lo, hi = node_start[n], node_start[n + 1]
            held = False
            for b in range(lo, hi):
                if quota_RD[r, b] > 0:
                    held = True
                    break
            if not held:
                continue
            for d in range(lo, hi):
                kept = min(loads_SE[d, e], quota_RD[r, d])
                kept_S[d] += kept
                supply[d] = loads_SE[d, e] - kept
                capacity[d] = quota_RD[r, d] - kept
                received_D[d] += capacity[d]
            a, b = lo, lo  # `_route`'s walk within the node
            while True:
                a, b = _next_match(supply, capacity, a, b, hi)
                if a == hi or b == hi:
                    break
                amount = min(supply[a], capacity[b])
                out[0, a] += amount
                out[2, b] += amount
                supply[a] -= amount
                capacity[b] -= amount
    for d in range(D):
        out[1, d] = sent_S[d] - kept_S[d] - out[0, d]
        out[3, d] = received_D[d] - out[2, d]
    return out


@_jit
def _sort_by_load(devices, n, load_D):
    """Sorts devices[:n] (ascending ids) in place by (load, id): stable, insertion sort for the
    few devices of a node or a round, merge sort beyond."""
    if n > 32:
        devices[:n] = devices[:n][np.argsort(load_D[devices[:n]], kind="mergesort")]
        return
    for i in range(1, n):
        d = devices[i]
        key = load_D[d]
        j = i - 1
        while j >= 0 and load_D[devices[j]] > key:
            devices[j + 1] = devices[j]
            j -= 1
        devices[j + 1] = d


@_jit
def _before(a, b, load_D):
    """Whether device a comes before device b in (predicted load, id) order."""
    return load_D[a] < load_D[b] or (load_D[a] == load_D[b] and a < b)


@_jit
def _resort_node(order_D, base, size, load_D):
    """Restores (load, id) order of one node's devices order_D[base:base + size] after some of
    their loads grew (insertion sort: the rest is still in order)."""
    for i in range(base + 1, base + size):
        d = order_D[i]
        j = i - 1
        while j >= base and _before(d, order_D[j], load_D):
            order_D[j + 1] = order_D[j]
            j -= 1
        order_D[j + 1] = d


@_jit
def copy_candidates(free_D, holds_D, load_D, devices_per_node, budget, order_D, first_round_N):
    """The first `budget` eligible devices (a free slot and no copy of the expert yet) in the
    order copies of one expert should go to them (DESIGN 4.2 step 3).

    Node by node, preferring nodes that do not hold the expert yet: a round robin over nodes in
    which a node's devices are ranked by (predicted load, id), giving each a round number
    0, 1, 2, ...; a node that already holds the expert starts at round 1. Devices are ordered
    by (round, predicted load, id), so the first copies land on distinct nodes that lack the
    expert, a node gets a second copy only when every node has one, and within a round the
    least-loaded devices come first.

    DESIGN ranks by "more free slots" where this ranks by predicted load: free-slot order puts
    copies on devices whose owned experts already exceed the mean load (docs/benchmarks.md,
    "Copy placement").

    `order_D` holds every node's devices in (load, id) order, node n's at n * devices_per_node
    (`place_copies` keeps it so as loads grow), so a round takes each node's next eligible device
    from it; first_round_N is 1 for the nodes that hold the expert, else 0. Only the rounds the
    budget reaches are built (before issue 44 this sorted all D devices three times per expert,
    until 2026-12-01 every node's devices once per expert).
    """
    D = free_D.size
    P = devices_per_node
    nodes = D // P
    next_N = np.arange(nodes) * P  # where each node's walk through its order is
    cand = np.empty(min(budget, D), dtype=np.int64)
    k = 0
    batch = np.empty(nodes, dtype=np.int64)
    rnd = 0
    while k < cand.size:
        b = 0
        waiting = False  # a node that starts at a later round still has devices
        for n in range(nodes):
            i = next_N[n]
            while i < n * P + P and (free_D[order_D[i]] <= 0 or holds_D[order_D[i]]):
                i += 1
            next_N[n] = i
            if i == n * P + P:
                continue
            if rnd < first_round_N[n]:
                waiting = True
                continue
            batch[b] = order_D[i]
            next_N[n] = i + 1
            b += 1
        if b == 0 and not waiting:
            break
        _sort_by_load(batch, b, load_D)
        take = min(b, cand.size - k)
        cand[k : k + take] = batch[:take]
        k += take
        rnd += 1
    return cand[:k]


@_jit
def place_copies(holds_ED, free_D, load_D, experts, budgets, loads_E, devices_per_node):
    """Gives each of `experts` (distinct, in the given order) up to its budget of copies; updates
    the arrays.

    `load_D` is the predicted device load (float [D]) so far; each expert's load is added to it
    split evenly over the expert's holders once its copies are placed, so later experts see
    where earlier ones went. For expert e with r current holders and load f, the candidates
    are `copy_candidates` (free slot, no copy of e yet) cut to the budget, and e takes the
    first j of them for the j in [0, budget] minimizing

        max(load of its current holders, load of the first j candidates) + f / (r + j),

    the predicted load of its busiest holder; ties go to fewer copies. An expert therefore
    stops short of its budget when the next candidate is already so loaded that another copy
    would only move the peak there.

    Deviation from DESIGN 4.2 step 3, which fills every budgeted copy: with all D*m slots
    filled, every device takes exactly m copies however the copies are ordered, including a
    device whose owned experts alone exceed the mean load. Stopping early balances better with
    an even-split dispatch and moves fewer spAG / spRS bytes with the balanced one
    (docs/benchmarks.md, "Copy placement").
    """
    D = free_D.size
    P = devices_per_node
    order_D = np.arange(D)  # each node's devices by (load, id), kept so as loads grow
    for n in range(D // P):
        _resort_node(order_D, n * P, P, load_D)
    touched_N = np.zeros(D // P, dtype=np.bool_)
    first_round_N = np.zeros(D // P, dtype=np.int64)
    ptr, dev = holder_lists(holds_ED)  # each expert's holders before its copies (experts are distinct)
    for x in range(experts.size):
        e, budget, f = experts[x], budgets[x], loads_E[experts[x]]
        holds_D = holds_ED[e]
        r = ptr[e + 1] - ptr[e]
        holders_peak = -np.inf
        for i in range(ptr[e], ptr[e + 1]):
            holders_peak = max(holders_peak, load_D[dev[i]])
        j = 0
        cand = np.empty(0, dtype=np.int64)
        if budget > 0 and f > 0:
            for i in range(ptr[e], ptr[e + 1]):
                first_round_N[dev[i] // P] = 1
            cand = copy_candidates(free_D, holds_D, load_D, devices_per_node, budget, order_D, first_round_N)
            for i in range(ptr[e], ptr[e + 1]):
                first_round_N[dev[i] // P] = 0
            if cand.size:
                # busiest holder's predicted load with the first j >= 1 candidates, vs j = 0
                best = np.inf
                peak = holders_peak
                for i in range(cand.size):
                    peak = max(peak, load_D[cand[i]])
                    value = peak + f / (r + 1 + i)
                    if value < best:
                        best, j = value, i + 1
                if holders_peak + f / r <= best:
                    j = 0
                for i in range(j):
                    holds_D[cand[i]] = True
                    free_D[cand[i]] -= 1
        share = f / (r + j)
        for i in range(ptr[e], ptr[e + 1] + j):  # its holders: the ones before, then its copies
            d = dev[i] if i < ptr[e + 1] else cand[i - ptr[e + 1]]
            load_D[d] += share
            touched_N[d // P] = True
        for i in range(ptr[e], ptr[e + 1] + j):
            d = dev[i] if i < ptr[e + 1] else cand[i - ptr[e + 1]]
            if touched_N[d // P]:
                _resort_node(order_D, d // P * P, P, load_D)
                touched_N[d // P] = False


@_jit
def compute_seconds(tokens_D, instances_D, seconds_per_token, seconds_per_instance):
    """`FSSDPCostModel.compute_seconds`: the busiest device's expert time."""
    peak = -np.inf
    for d in range(tokens_D.size):
        peak = max(peak, tokens_D[d] * seconds_per_token + instances_D[d] * seconds_per_instance)
    return peak


@_jit
def exposed_reduce_seconds(gather_s, compute_s, reduce_ratio, reduce_hidden_s, backward_share):
    """`FSSDPCostModel.exposed_reduce_seconds`: the copies' reduce past the backward compute beside it."""
    return max(0.0, reduce_ratio * gather_s - (reduce_hidden_s + backward_share * compute_s))


@_jit
def exposed_seconds(gather_s, gather_hidden_s, compute_s, reduce_ratio, reduce_hidden_s, backward_share):
    """`FSSDPCostModel.exposed_seconds`: the gather past what hides it, plus its reduce's."""
    return max(0.0, gather_s - gather_hidden_s) + exposed_reduce_seconds(
        gather_s, compute_s, reduce_ratio, reduce_hidden_s, backward_share)


@_jit
def least_exposed_seconds(gather_s, best_s, reduce_ratio, reduce_hidden_s, backward_share):
    """`FSSDPCostModel.least_exposed_seconds`."""
    return gather_s + max(0.0, reduce_ratio * gather_s - reduce_hidden_s - backward_share * best_s)


@_jit
def _cheapest_target(holds_D, has_free_D, load_D, peak, src, node_of, copy_intra_s, copy_inter_s,
                     seconds_per_token):
    """The device without a copy, with a free slot and a load below peak - 1 where a copy from
    `src` is cheapest (load x seconds per token + transfer), the lowest id on ties; -1 if none."""
    best, target = np.inf, -1
    for t in range(load_D.size):
        if not holds_D[t] and has_free_D[t] and load_D[t] < peak - 1:
            price = load_D[t] * seconds_per_token + (copy_intra_s if node_of[t] == node_of[src] else copy_inter_s)
            if price < best:
                best, target = price, t
    return target


@_jit
def relief_chain(held_ED, quota_ED, owner_E, tokens_E, free_D, node_of, copy_intra_s, copy_inter_s,
                 seconds_per_token, seconds_per_instance, latency_s, reduce_ratio, reduce_hidden_s,
                 backward_share):
    """The chain of `calibrate._relief_candidate` (its docstring has the rule), cut at its
    cheapest prefix; returns (experts, targets) of the copies, int64 [n] each. quota_ED (int64
    [E, D], the balanced quotas of held_ED) is overwritten: at E = 256, D = 1,024 a copy of it
    is 2 MB."""
    E, D = held_ED.shape
    holds_ED = held_ED.copy()
    free_D = free_D.copy()
    has_free_D = free_D > 0
    open_slots = np.count_nonzero(has_free_D)
    load_D = np.zeros(D, dtype=np.int64)
    instances_D = np.zeros(D, dtype=np.int64)
    for e in range(E):
        for d in range(D):  # no branch: vectorized
            load_D[d] += quota_ED[e, d]
            instances_D[d] += quota_ED[e, d] > 0
    floor = -(-tokens_E.sum() // D)  # no placement gets the peak below this
    send_D = np.zeros(D)
    recv_D = np.zeros(D)
    gather_s = 0.0  # busiest sender or receiver so far
    chain_E = np.empty(max(free_D.sum(), 0), dtype=np.int64)
    chain_T = np.empty_like(chain_E)
    n = 0
    d = np.argmax(load_D)
    best_s, best_n = compute_seconds(load_D, instances_D, seconds_per_token, seconds_per_instance), 0
    new_H = np.empty(D, dtype=np.int64)
    while open_slots:
        peak = load_D[d]
        if peak <= floor:
            break
        # the busiest device's experts by quota, largest first (ties: lower id), the first that
        # can still get a copy
        e = np.argmax(quota_ED[:, d])
        target = -1
        if quota_ED[e, d] > 0:
            target = _cheapest_target(holds_ED[e], has_free_D, load_D, peak, owner_E[e], node_of, copy_intra_s,
                                      copy_inter_s, seconds_per_token)
            if target < 0:
                order = np.argsort(-quota_ED[:, d], kind="mergesort")
                for i in range(1, E):
                    e = order[i]
                    if quota_ED[e, d] == 0:
                        break
                    target = _cheapest_target(holds_ED[e], has_free_D, load_D, peak, owner_E[e], node_of,
                                              copy_intra_s, copy_inter_s, seconds_per_token)
                    if target >= 0:
                        break
        if target < 0:
            break
        src = owner_E[e]
        holds_ED[e, target] = True
        free_D[target] -= 1
        if free_D[target] == 0:
            has_free_D[target] = False
            open_slots -= 1
        copy_s = copy_intra_s if node_of[target] == node_of[src] else copy_inter_s
        send_D[src] += copy_s
        recv_D[target] += copy_s
        gather_s = max(gather_s, send_D[src], recv_D[target])
        chain_gather_s = gather_s + latency_s
        if floor * seconds_per_token + least_exposed_seconds(chain_gather_s, best_s, reduce_ratio, reduce_hidden_s,
                                                             backward_share) >= best_s:
            break  # the gather only grows along the chain: no longer prefix can be cheaper
        chain_E[n], chain_T[n] = e, target
        n += 1
        # refill e's tokens over its holders
        H = 0
        for h in range(D):
            if holds_ED[e, h]:
                new_H[H] = load_D[h] - quota_ED[e, h]
                H += 1
        base_H = new_H[:H].copy()
        fill_sorted(base_H, tokens_E[e], new_H[:H])
        i = 0
        for h in range(D):
            if holds_ED[e, h]:
                instances_D[h] += (1 if new_H[i] > 0 else 0) - (1 if quota_ED[e, h] > 0 else 0)
                quota_ED[e, h] = new_H[i]
                load_D[h] = base_H[i] + new_H[i]
                i += 1
        d = np.argmax(load_D)
        compute_s = compute_seconds(load_D, instances_D, seconds_per_token, seconds_per_instance)
        seconds = compute_s + exposed_seconds(chain_gather_s, 0.0, compute_s, reduce_ratio, reduce_hidden_s,
                                              backward_share)
        if seconds < best_s:
            best_s, best_n = seconds, n
    return chain_E[:best_n].copy(), chain_T[:best_n].copy()


@_jit
def copies_seconds(holds_ED, have_ED, owner_E, node_of, copy_intra_s, copy_inter_s):
    """Transfer time of gathering the copies in holds_ED that have_ED lacks from their owners:
    the busiest device's receives or sends, each copy at copy_intra_s or copy_inter_s; -1.0
    when there is no such copy (`FSSDPCostModel`'s point-to-point gather model)."""
    E, D = holds_ED.shape
    recv_D = np.zeros(D)
    send_D = np.zeros(D)
    any_copy = False
    for e in range(E):
        src = owner_E[e]
        for d in range(D):
            if holds_ED[e, d] and not have_ED[e, d]:
                seconds = copy_intra_s if node_of[d] == node_of[src] else copy_inter_s
                recv_D[d] += seconds
                send_D[src] += seconds
                any_copy = True
    return max(recv_D.max(), send_D.max()) if any_copy else -1.0


@_jit
def relay_sources(holds_ED, owner_E, devices_per_node, relays):
    """`collectives.relay_sources_ED` of valid inputs (its docstring has the rule): who sends
    each copy, -1 where nothing is received; int64 [E, D]. Without `relays` (flat, or one node)
    every copy comes from its owner."""
    E, D = holds_ED.shape
    P = devices_per_node
    source_ED = np.full((E, D), -1, dtype=np.int64)
    for e in range(E):
        owner = owner_E[e]
        for n in range(D // P):
            base = n * P
            if not relays or n == owner // P:
                for d in range(base, base + P):
                    if holds_ED[e, d] and d != owner:
                        source_ED[e, d] = owner
                continue
            count = 0
            for d in range(base, base + P):
                if holds_ED[e, d]:
                    count += 1
            if count == 0:
                continue
            relay, i = -1, 0
            for d in range(base, base + P):  # holder number e mod count, ascending
                if holds_ED[e, d]:
                    if i == e % count:
                        relay = d
                    i += 1
            for d in range(base, base + P):
                if holds_ED[e, d]:
                    source_ED[e, d] = owner if d == relay else relay
    return source_ED


@_jit
def holder_lists(held_ED):
    """Each expert's holders, ascending, in CSR form: (ptr int64 [E + 1], dev int64 [nnz]),
    expert e's holders dev[ptr[e]:ptr[e + 1]]. Skips 8 devices at a time where none holds the
    expert (a dense [256, 1,024] walk byte by byte: 0.12 ms; by words: 0.06 ms)."""
    E, D = held_ED.shape
    bytes_ED = held_ED.view(np.uint8)
    words = D // 8
    ptr = np.zeros(E + 1, dtype=np.int64)
    total = 0
    for e in range(E):
        for d in range(D):
            total += bytes_ED[e, d]
    dev = np.empty(total, dtype=np.int64)
    k = 0
    for e in range(E):
        row = bytes_ED[e]
        row_words = row[: 8 * words].view(np.uint64)
        for w in range(words):
            if row_words[w]:
                for d in range(8 * w, 8 * w + 8):
                    if row[d]:
                        dev[k] = d
                        k += 1
        for d in range(8 * words, D):
            if row[d]:
                dev[k] = d
                k += 1
        ptr[e + 1] = k
    return ptr, dev


@_jit
def split_holders(ptr, dev, tokens_E, num_devices):
    """The single-holder and the replicated experts of holder lists (`holder_lists`), in one
    pass: (single_E bool [E], holder_E int64 [E]: the first holder, -1 for an expert without
    one; load_D and busy_D int64 [D]: tokens and experts with tokens of the single-holder
    experts at their holders; rep int64 [R]: the replicated experts, ascending; rep_ptr int64
    [R + 1] and rep_dev int64 [P]: their holder lists)."""
    E = ptr.size - 1
    single_E = np.zeros(E, dtype=np.bool_)
    holder_E = np.full(E, -1, dtype=np.int64)
    load_D = np.zeros(num_devices, dtype=np.int64)
    busy_D = np.zeros(num_devices, dtype=np.int64)
    R, P = 0, 0
    for e in range(E):
        count = ptr[e + 1] - ptr[e]
        if count:
            holder_E[e] = dev[ptr[e]]
        if count == 1:
            single_E[e] = True
            load_D[holder_E[e]] += tokens_E[e]
            if tokens_E[e] > 0:
                busy_D[holder_E[e]] += 1
        elif count > 1:
            R += 1
            P += count
    rep = np.empty(R, dtype=np.int64)
    rep_ptr = np.zeros(R + 1, dtype=np.int64)
    rep_dev = np.empty(P, dtype=np.int64)
    r, k = 0, 0
    for e in range(E):
        if ptr[e + 1] - ptr[e] > 1:
            rep[r] = e
            for i in range(ptr[e], ptr[e + 1]):
                rep_dev[k] = dev[i]
                k += 1
            r += 1
            rep_ptr[r] = k
    return single_E, holder_E, load_D, busy_D, rep, rep_ptr, rep_dev


@_jit
def replicated_quota_rows(rep_ptr, rep_dev, tokens_R, load_D):
    """`quotas.replicated_quotas` of the replicated experts' holder lists: the fill order (heaviest
    first, ties: lower index), the bound below which a second sweep cannot lower the peak,
    `sweep_quotas`, and the quotas written as rows; int64 [R, D]."""
    R, D = tokens_R.size, load_D.size
    total = load_D.sum() + tokens_R.sum()
    bound = max(load_D.max(), -(-total // D))
    order_R = np.argsort(-tokens_R, kind="mergesort")
    quota_P = sweep_quotas(rep_ptr, rep_dev, tokens_R, load_D, order_R, bound)
    quota_RD = np.zeros((R, D), dtype=np.int64)
    for r in range(R):
        for i in range(rep_ptr[r], rep_ptr[r + 1]):
            quota_RD[r, rep_dev[i]] = quota_P[i]
    return quota_RD


@_jit
def copy_stage_bytes(ptr, dev, owner_E, devices_per_node, relays, ring_E, size_E, node_of):
    """The bytes of each stage of spAG(owners -> holders in CSR form, `holder_lists`), the
    senders `collectives.copy_sources` names, without its [E, D] source table: the owner sends the copies on its node
    and, on every other node that holds the expert, to the node's relay (holder number e mod
    the node's holders there, ascending; with `relays`), which sends the node's other copies;
    without `relays` the owner sends every copy; an expert with ring_E is broadcast along the
    ring of all devices (d receives from d - 1) instead. int64 [3, 4, D] (stages: owners' sends,
    ring broadcasts, relays' sends; rows as `add_link`). Adds in (expert, device) order, as
    `links.CommBytes.from_transfers` sums the same transfers, and truncates the same way."""
    D = node_of.size
    P = devices_per_node
    out = np.zeros((3, 4, D))
    for e in range(owner_E.size):
        owner, size = owner_E[e], size_E[e]
        lo, hi = ptr[e], ptr[e + 1]
        if ring_E[e]:
            for d in range(D):
                if d != owner:
                    add_link(out[1], node_of, d - 1 if d > 0 else D - 1, d, size)
            continue
        i = lo
        while i < hi:
            n = dev[i] // P
            j = i
            while j < hi and dev[j] // P == n:
                j += 1
            if not relays or n == owner // P:
                for k in range(i, j):
                    if dev[k] != owner:
                        add_link(out[0], node_of, owner, dev[k], size)
            else:
                relay = dev[i + e % (j - i)]
                for k in range(i, j):
                    if dev[k] == relay:
                        add_link(out[0], node_of, owner, relay, size)
                    else:
                        add_link(out[2], node_of, relay, dev[k], size)
            i = j
    return out.astype(np.int64)


@_jit
def owner_traffic(loads_SE, grid, dest_G, source_P, dest_P, tokens_P, num_devices):
    """`DispatchPlan.traffic_SD` of a `by_owner` plan: tokens from each source to each device,
    to itself included; the grid experts' (source s sends all of grid[g] to dest_G[g]) and the
    pieces'; int64 [S, D]."""
    S = loads_SE.shape[0]
    out = np.zeros((S, num_devices), dtype=np.int64)
    for source in range(S):
        for g in range(grid.size):
            out[source, dest_G[g]] += loads_SE[source, grid[g]]
    for p in range(source_P.size):
        out[source_P[p], dest_P[p]] += tokens_P[p]
    return out


@_jit
def spread_replicated(loads_RE, counts_ED, cap):
    """`replicate.spread_tokens`'s spread (its docstring has the rule) of validated inputs: each
    rank's tokens of an expert go to its own instances up to their capacity, the rest evenly
    over the expert's other instances, and a receiver serves its local tokens first, then the
    arrivals in ascending source order. One pass in (expert, source) order, which is the
    order a receiver serves its arrivals in, so each transfer's kept tokens are known when it
    is made.

    Returns (processed_ED, dropped_E, entries int64 [5, K]: source, expert, destination,
    tokens, kept), the entries in `spread_tokens`' order: the local ones by (expert, rank),
    then the remote shares by (expert, source, position among the remote instances).
    """
    R, E = loads_RE.shape
    inst_E = counts_ED.sum(axis=1)
    start_E = np.zeros(E + 1, dtype=np.int64)
    for e in range(E):
        start_E[e + 1] = start_E[e] + inst_E[e]
    inst_rank = np.empty(start_E[E], dtype=np.int64)  # each expert's instances' ranks, ascending
    local_ED = np.empty((E, R), dtype=np.int64)
    K = 0
    for e in range(E):
        i = start_E[e]
        for r in range(R):
            for _ in range(counts_ED[e, r]):
                inst_rank[i] = r
                i += 1
            local_ED[e, r] = min(loads_RE[r, e], cap * counts_ED[e, r])
            over = loads_RE[r, e] - local_ED[e, r]
            K += (local_ED[e, r] > 0) + (min(over, inst_E[e] - counts_ED[e, r]) if over > 0 else 0)
    out = np.empty((5, K), dtype=np.int64)
    k = 0
    for e in range(E):
        for r in range(R):
            if local_ED[e, r] > 0:
                out[0, k], out[1, k], out[2, k], out[3, k], out[4, k] = r, e, r, local_ED[e, r], local_ED[e, r]
                k += 1
    arrivals_ED = np.zeros((E, R), dtype=np.int64)
    dropped_E = np.zeros(E, dtype=np.int64)
    for e in range(E):
        own_start = 0  # where rank r's own run of instances starts in e's list
        for r in range(R):
            n = loads_RE[r, e] - local_ED[e, r]
            remote = inst_E[e] - counts_ED[e, r]
            if n > 0 and remote == 0:
                dropped_E[e] += n
            elif n > 0:
                quotient, remainder = n // remote, n % remote
                for i in range(min(n, remote)):
                    pos = r % remote + i  # remote instance r mod k + i (mod k), skipping r's own run
                    if pos >= remote:
                        pos -= remote
                    if pos >= own_start:
                        pos += counts_ED[e, r]
                    dest = inst_rank[start_E[e] + pos]
                    share = quotient + (1 if i < remainder else 0)
                    room = cap * counts_ED[e, dest] - local_ED[e, dest]
                    kept = min(max(room - arrivals_ED[e, dest], 0), share)
                    arrivals_ED[e, dest] += share
                    out[0, k], out[1, k], out[2, k], out[3, k], out[4, k] = r, e, dest, share, kept
                    k += 1
            own_start += counts_ED[e, r]
    processed_ED = local_ED.copy()
    for e in range(E):
        for r in range(R):
            remote_kept = min(arrivals_ED[e, r], cap * counts_ED[e, r] - local_ED[e, r])
            processed_ED[e, r] += remote_kept
            dropped_E[e] += arrivals_ED[e, r] - remote_kept
    return processed_ED, dropped_E, out


@_jit
def balanced_slots(order_E, counts_E, weight_E, num_ranks, slots_per_rank):
    """`replicate.assign_slots`'s layout (its docstring has the rule) of validated inputs:
    experts in `order_E`, each expert's counts_E[e] instances of weight weight_E[e] one after
    the other, each to the rank with the least weight so far among those with a free slot
    (ties: the lower rank; a min-heap of (weight, rank)). Returns int64 [G, s], each row
    ascending."""
    heap = [(0.0, r) for r in range(num_ranks)]  # ascending: already a heap
    slot_RS = np.empty((num_ranks, slots_per_rank), dtype=np.int64)
    used_R = np.zeros(num_ranks, dtype=np.int64)
    for e in order_E:
        for _ in range(counts_E[e]):
            weight, r = heapq.heappop(heap)
            slot_RS[r, used_R[r]] = e
            used_R[r] += 1
            if used_R[r] < slots_per_rank:
                heapq.heappush(heap, (weight + weight_E[e], r))
    for r in range(num_ranks):
        slot_RS[r].sort()
    return slot_RS


@_jit
def load_sums(loads_SE):
    """(least entry, column sums int64 [E], row sums int64 [S]) of int64 [S, E] loads in one pass
    (numpy's three reductions took 0.2 ms at S = 1,024, E = 256)."""
    S, E = loads_SE.shape
    least = 0
    col_E = np.zeros(E, dtype=np.int64)
    row_S = np.zeros(S, dtype=np.int64)
    for s in range(S):
        total = 0
        for e in range(E):
            x = loads_SE[s, e]
            least = min(least, x)
            col_E[e] += x
            total += x
        row_S[s] = total
    return least, col_E, row_S


@_jit
def transfer_seconds(sent_intra_D, sent_inter_D, recv_intra_D, recv_inter_D, intra_bw, inter_bw):
    """`links.transfer_seconds` of the four per-device byte arrays: the busiest device's
    intra-node bytes (sent or received) over intra_bw or inter-node bytes over inter_bw,
    whichever is longer; 0.0 without devices. The planners price a few such sets per candidate
    placement; in numpy each took eight calls."""
    most = 0.0
    for d in range(sent_intra_D.size):
        intra = max(sent_intra_D[d], recv_intra_D[d]) / intra_bw
        inter = max(sent_inter_D[d], recv_inter_D[d]) / inter_bw
        most = max(most, intra, inter)
    return most


@_jit
def link_sums(src_K, dst_K, amount_K, node_of):
    """Per-device sums of point-to-point transfers by link class: (sent within the node, sent to
    other nodes, received within the node, from other nodes), float [4, D]; transfers to self
    are free. Sums in the transfers' order, as `np.bincount` with weights does."""
    out = np.zeros((4, node_of.size))
    for k in range(src_K.size):
        src, dst = src_K[k], dst_K[k]
        if src != dst:
            add_link(out, node_of, src, dst, amount_K[k])
    return out
