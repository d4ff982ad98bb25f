"""Zebra parallelism planning: the profile, Asym-EA ("gather and squeeze") and the task order.

Zebra mode (DESIGN 4.7, 4.8) splits a ZP group into M attention ranks (newer GPUs: embeddings,
attention, gate, norms, head; replicated data-parallel) and N expert ranks (older GPUs: the
experts of every MoE layer, expert-parallel). This package holds the pure planning side of it, one module per part:

1. `profile`: ``ZebraShape`` / ``ZebraProfile`` / ``DeviceProfile``: the model/group shape and the profiled
   per-micro-batch times and memory bounds, with a JSON file format that the profiler merges
   into, one entry per device type.
2. `asym_ea`: ``asym_ea`` / ``resolve_asym_ea``: how many experts of each layer move from the expert ranks
   to the attention ranks ("chunks" per layer), and ``expert_owners`` for the concrete owners.
3. `schedule`: ``task_order`` (and its no-overlap baseline ``naive_order``) / ``build_schedule``: the Theorem-1 order of compute and communication tasks per
   stream for both roles, as data with explicit dependencies; ``check_deadlock_free`` and a
   tiny discrete-event ``simulate_schedule``.
4. `cost`: ``zebra_durations`` / ``iteration_time``: an exact cost model of one iteration of the zig-zag
   pipeline as a function of the per-layer offload counts, built on the two pieces above. The
   tests use it to brute-force the best offload vector on small cases and compare Asym-EA with it.

The reading of T_squeeze implemented here (the published formula is ambiguous about which of n1,
n2 multiplies which time):

    per-expert time on an expert GPU     tau_E = T_E^exp  / (n/N)
    per-expert time on an attention GPU  tau_A = T_E^attn / (n/N)
    T_squeeze = n2 * tau_E + n1 * tau_A

Why: one chunk takes n2 experts away from *every* expert GPU (each then computes n2 experts
less: it saves n2 * tau_E) and gives n1 experts to *every* attention GPU (each computes n1
experts more: its idle time shrinks by n1 * tau_A). Every expert sees the same tokens wherever it
lives (it receives the tokens of all M attention ranks), so the per-expert times do not depend on
M or N beyond the n/N normalisation. The per-layer bubble T_E^exp - T_A^attn therefore shrinks by
exactly n2 * tau_E + n1 * tau_A per chunk. The other reading (n1 * tau_E + n2 * tau_A) coincides
with this one only when M == N; the tests show it mis-sizes the offload when M != N.

Everything here is pure Python / numpy and deterministic: every rank computes the same plan.
"""

from megatron_patches.placement.zebra.asym_ea import (  # noqa: F401
    AsymEAPlan,
    asym_ea,
    expert_owners,
    max_chunks_per_layer,
    resolve_asym_ea,
    squeeze_time,
)
from megatron_patches.placement.zebra.cost import (  # noqa: F401
    iteration_time,
    zebra_durations,
)
from megatron_patches.placement.zebra.profile import (  # noqa: F401
    KINDS,
    PHASES,
    PROFILE_FORMAT,
    ROLES,
    STREAMS,
    DeviceProfile,
    ZebraProfile,
    ZebraShape,
    chunk_sizes,
    load_zebra_profile,
    profile_from_devices,
    save_device_profile,
)
from megatron_patches.placement.zebra.schedule import (  # noqa: F401
    ORDERS,
    Schedule,
    Task,
    build_schedule,
    check_deadlock_free,
    naive_order,
    simulate_schedule,
    task_order,
)
