"""Zebra planning, part 3: the Theorem-1 order of compute and communication tasks per stream for
both roles (DESIGN 4.7), as data with explicit dependencies; a deadlock check and a tiny
discrete-event simulation."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Mapping, Sequence

import numpy as np

from megatron_patches.placement.zebra.profile import KINDS, PHASES, ROLES, STREAMS

# --------------------------------------------------------------------------------------------
# Theorem-1 task order (DESIGN 4.7)
# --------------------------------------------------------------------------------------------
#
# Indexing. Attention tasks run for layers 0..L: A(l) for l < L is [the combine of MoE layer l-1
# (weighted sum with the gate scores, residual add) or the embedding for l = 0] + norms +
# attention + gate of layer l; A(L) is the output head (combine of MoE layer L-1, final norm,
# output projection, loss). Expert tasks E(l) and communication tasks D(l), C(l) exist for l < L.
#
# Data flow for micro-batch j (every edge is a dependency in Task.deps):
#   forward   A_F(l,j) -> D_F(l,j) -> E_F(l,j) -> C_F(l,j) -> A_F(l+1,j);  A_F(l,j) -> A_F(l+1,j)
#   head      A_F(L,j) -> A_B(L,j)
#   backward  A_B(l+1,j) -> C_B(l,j) -> E_B(l,j) -> D_B(l,j) -> A_B(l,j);  A_B(l+1,j) -> A_B(l,j)
#             and every backward task depends on its own forward task (saved activations).
# Directions of the all-to-alls (bipartite between the M attention and N expert ranks):
#   D_F: attention -> expert (tokens after the gate)
#   C_F: expert -> attention (expert outputs)
#   C_B: attention -> expert (gradient of the expert outputs, produced by A_B(l+1,j))
#   D_B: expert -> attention (gradient of the expert inputs). A_B(l,j) adds it to the gate-branch
#        gradient before running the attention backward, so no weight gets its backward twice.
# Streams: D tasks run on the "dispatch" stream/group and C tasks on the "combine" stream/group
# of both roles; in each phase the two flow in opposite directions, so they never queue behind
# each other. An all-to-all is one task that sits in the queue of that stream on both roles and
# starts when it is at the head of both (a collective needs every member).
# With Asym-EA, a layer with offloaded experts also has E tasks on the attention ranks' compute
# stream (their share of the experts); D_F / D_B then also carry tokens between attention ranks
# and C_F(l,j) / D_B(l,j) wait for both roles' E tasks. See _insert_attention_experts for where
# they sit in the compute order.


@dataclass(frozen=True)
class Task:
    """One compute or communication task of the zebra schedule."""

    kind: str
    """"A" attention block, "D" dispatch all-to-all, "E" experts, "C" combine all-to-all."""
    phase: str
    """"F" forward or "B" backward."""
    layer: int
    """Layer index: 0..L for A (L is the head), 0..L-1 for D, E, C."""
    microbatch: int
    """Micro-batch index 0..R-1."""
    stream: str
    """"compute" for A and E, "dispatch" for D, "combine" for C."""
    role: str
    """Where it runs: "attention" or "expert" for compute tasks, "group" for all-to-alls (one
    collective over both roles' queues)."""
    deps: tuple[str, ...] = field(default=())
    """Ids of the tasks whose outputs this task consumes."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.phase not in PHASES or self.stream not in STREAMS:
            raise ValueError(
                f"task ({self.kind!r}, {self.phase!r}, stream {self.stream!r}): kind must be one of "
                f"{KINDS}, phase one of {PHASES}, stream one of {STREAMS}"
            )
        if self.role not in (*ROLES, "group"):
            raise ValueError(f"task role must be one of {(*ROLES, 'group')}, got {self.role!r}")

    @cached_property
    def label(self) -> str:
        """Role-free name, e.g. "A_F(1,0)"."""
        return f"{self.kind}_{self.phase}({self.layer},{self.microbatch})"

    @cached_property
    def id(self) -> str:
        """Unique id: compute tasks are prefixed by their role ("expert:E_F(0,1)"), all-to-alls
        are shared by both roles ("D_F(0,1)")."""
        return self.label if self.role == "group" else f"{self.role}:{self.label}"


def _att(kind: str, phase: str, layer: int, mb: int) -> str:
    return f"attention:{kind}_{phase}({layer},{mb})"


def _exp(phase: str, layer: int, mb: int) -> str:
    return f"expert:E_{phase}({layer},{mb})"


def _comm(kind: str, phase: str, layer: int, mb: int) -> str:
    return f"{kind}_{phase}({layer},{mb})"


def _tasks_of_step(
    kind: str, phase: str, layer: int, mb: int, num_layers: int, offloaded: frozenset[int]
) -> dict[str, Task]:
    """The tasks created for one (kind, phase, layer, micro-batch) with their dependencies."""
    L = num_layers
    if kind == "A" and phase == "F":
        deps = () if layer == 0 else (_att("A", "F", layer - 1, mb), _comm("C", "F", layer - 1, mb))
        return {"attention": Task("A", "F", layer, mb, "compute", "attention", deps)}
    if kind == "A" and phase == "B":
        own = _att("A", "F", layer, mb)
        deps = (own,) if layer == L else (own, _att("A", "B", layer + 1, mb), _comm("D", "B", layer, mb))
        return {"attention": Task("A", "B", layer, mb, "compute", "attention", deps)}
    if kind == "E":
        incoming = _comm("D", "F", layer, mb) if phase == "F" else _comm("C", "B", layer, mb)
        saved = (_exp("F", layer, mb),) if phase == "B" else ()
        tasks = {"expert": Task("E", phase, layer, mb, "compute", "expert", (incoming, *saved))}
        if layer in offloaded:
            saved = (_att("E", "F", layer, mb),) if phase == "B" else ()
            tasks["attention"] = Task("E", phase, layer, mb, "compute", "attention", (incoming, *saved))
        return tasks
    producers = {
        ("D", "F"): (_att("A", "F", layer, mb),),
        ("C", "F"): (_exp("F", layer, mb),) + ((_att("E", "F", layer, mb),) if layer in offloaded else ()),
        ("C", "B"): (_att("A", "B", layer + 1, mb),),
        ("D", "B"): (_exp("B", layer, mb),) + ((_att("E", "B", layer, mb),) if layer in offloaded else ()),
    }[(kind, phase)]
    stream = "dispatch" if kind == "D" else "combine"
    return {"group": Task(kind, phase, layer, mb, stream, "group", producers)}


def task_order(
    num_layers: int, num_microbatches: int, role: str, offloaded_layers: Sequence[int] = ()
) -> dict[str, list[Task]]:
    """Theorem-1 order of every stream of one rank of ``role`` ("attention" or "expert").

    Returns {"compute": [...], "dispatch": [...], "combine": [...]}, each list in execution
    order. Attention compute: A_F layer-major / micro-batch-minor for layers 0..L-1, then for
    each micro-batch A_F(L,j) immediately followed by A_B(L,j) (the head), then A_B layer-major
    descending (L-1..0) / micro-batch-minor. Expert compute: E_F layer-major / micro-batch-minor,
    then E_B for layers L-1..0, micro-batch-minor. Communication tasks are enqueued right after
    their producer: on the producing role in the producer's order, and on the receiving role in
    the same order (all-to-alls are collectives, so both queues must agree).
    ``offloaded_layers``: layers with Asym-EA experts on attention ranks (adds their E tasks).
    """
    if not isinstance(num_layers, (int, np.integer)) or num_layers < 1:
        raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
    if not isinstance(num_microbatches, (int, np.integer)) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    offloaded = frozenset(int(l) for l in offloaded_layers)
    bad = sorted(l for l in offloaded if not 0 <= l < num_layers)
    if bad:
        raise ValueError(f"offloaded_layers {bad} out of range 0..{num_layers - 1}")
    L, R = num_layers, num_microbatches

    if role == "attention":
        steps = [("A", "F", l, j) for l in range(L) for j in range(R)]
        steps += [step for j in range(R) for step in (("A", "F", L, j), ("A", "B", L, j))]
        steps += [("A", "B", l, j) for l in reversed(range(L)) for j in range(R)]
    else:
        steps = [("E", "F", l, j) for l in range(L) for j in range(R)]
        steps += [("E", "B", l, j) for l in reversed(range(L)) for j in range(R)]

    compute = [_tasks_of_step(k, ph, l, j, L, offloaded)[role] for k, ph, l, j in steps]
    if role == "attention" and offloaded:
        compute = _insert_attention_experts(compute, L, R, offloaded)
    # Every all-to-all in the order its producers run (forward layer-major, then backward from
    # the last layer), which is also the order its consumers need it; the same on both roles.
    comm_order = [(ph, l, j) for ph, layers in (("F", range(L)), ("B", reversed(range(L)))) for l in layers for j in range(R)]
    return {
        "compute": compute,
        "dispatch": [_tasks_of_step("D", ph, l, j, L, offloaded)["group"] for ph, l, j in comm_order],
        "combine": [_tasks_of_step("C", ph, l, j, L, offloaded)["group"] for ph, l, j in comm_order],
    }


def naive_order(num_layers: int, num_microbatches: int, role: str, offloaded_layers: Sequence[int] = ()) -> dict[str, list[Task]]:
    """The no-overlap baseline of ``task_order`` (tools/bench_zebra.py): per stream, the
    one-micro-batch Theorem-1 order repeated R times, so a rank never works on two micro-batches
    at once."""
    single = task_order(num_layers, 1, role, offloaded_layers)

    def relabel(task: Task, mb: int) -> Task:
        return replace(task, microbatch=mb, deps=tuple(d.replace(",0)", f",{mb})") for d in task.deps))

    return {stream: [relabel(t, mb) for mb in range(num_microbatches) for t in tasks] for stream, tasks in single.items()}


ORDERS: dict[str, Callable[..., dict[str, list[Task]]]] = {"zebra": task_order, "naive": naive_order}
"""The task orders a zebra engine can run, by name: "zebra" the Theorem-1 order, "naive" one
micro-batch at a time (its whole forward and backward before the next one starts)."""


def _insert_attention_experts(
    compute: list[Task], num_layers: int, num_microbatches: int, offloaded: frozenset[int]
) -> list[Task]:
    """Place the attention ranks' expert tasks into their compute order.

    E_F(l,j) needs D_F(l,j), which starts only when A_F(l,j) has ended; E_B(l,j) needs C_B(l,j)
    after A_B(l+1,j). Run right after that producer, the compute stream would idle for the whole
    all-to-all, so each is deferred by one task: it runs after the compute task that follows its
    producer, which hides an all-to-all up to that task's length. With R >= 2 that following
    task never depends on the deferred one: it is either the same step's next micro-batch, or
    micro-batch 0 of the next step, which needs only the E task of micro-batch 0 (placed
    earlier). With R == 1 it would (A_F(l+1,0) needs C_F(l,0)), so there the E task runs right
    after its producer and the compute stream waits for the all-to-all.
    """
    producer_of = {}
    for layer in offloaded:
        for mb in range(num_microbatches):
            producer_of[_att("A", "F", layer, mb)] = _tasks_of_step("E", "F", layer, mb, num_layers, offloaded)
            producer_of[_att("A", "B", layer + 1, mb)] = _tasks_of_step("E", "B", layer, mb, num_layers, offloaded)
    delay = 1 if num_microbatches >= 2 else 0
    slots: list[list[Task]] = [[] for _ in compute]
    for position, task in enumerate(compute):
        if task.id in producer_of:
            slots[min(position + delay, len(compute) - 1)].append(producer_of[task.id]["attention"])
    return [t for task, extra in zip(compute, slots) for t in (task, *extra)]


Schedule = dict[tuple[str, str], list[Task]]
"""(role, stream) -> tasks in execution order; all-to-all tasks appear under both roles."""


def build_schedule(num_layers: int, num_microbatches: int, offloaded_layers: Sequence[int] = ()) -> Schedule:
    """The full ZP-group schedule: both roles' streams from ``task_order``."""
    return {
        (role, stream): tasks
        for role in ROLES
        for stream, tasks in task_order(num_layers, num_microbatches, role, offloaded_layers).items()
    }


def _schedule_graph(schedule: Schedule) -> tuple[dict[str, Task], dict[str, list[str]]]:
    """All tasks by id and each task's predecessors (data deps + stream predecessors)."""
    tasks: dict[str, Task] = {}
    preds: dict[str, list[str]] = {}
    for (role, stream), queue in schedule.items():
        if role not in ROLES or stream not in STREAMS:
            raise ValueError(f"schedule key {(role, stream)} is not a (role in {ROLES}, stream in {STREAMS})")
        previous = None
        for task in queue:
            if task.stream != stream or task.role not in (role, "group"):
                raise ValueError(f"task {task.id} (stream {task.stream}) is queued on {role}/{stream}")
            if task.id in tasks and tasks[task.id] != task:
                raise ValueError(f"two different tasks share the id {task.id}")
            if task.id not in tasks:
                tasks[task.id] = task
                preds[task.id] = list(task.deps)
            if previous is not None:
                preds[task.id].append(previous)
            previous = task.id
    for task_id, ps in preds.items():
        unknown = [p for p in ps if p not in tasks]
        if unknown:
            raise ValueError(f"task {task_id} depends on {unknown}, which no stream runs")
    return tasks, preds


def _topological_order(schedule: Schedule) -> tuple[dict[str, Task], dict[str, list[str]], list[str]]:
    tasks, preds = _schedule_graph(schedule)
    succs: dict[str, list[str]] = {t: [] for t in tasks}
    missing = {t: 0 for t in tasks}
    for t, ps in preds.items():
        for p in ps:
            succs[p].append(t)
            missing[t] += 1
    ready = [t for t in tasks if missing[t] == 0]
    order = []
    while ready:
        t = ready.pop()
        order.append(t)
        for s in succs[t]:
            missing[s] -= 1
            if missing[s] == 0:
                ready.append(s)
    if len(order) != len(tasks):
        stuck = sorted(t for t in tasks if missing[t] > 0)
        raise ValueError(
            f"the schedule deadlocks: {len(stuck)} tasks wait on each other through their "
            f"dependencies and stream order, e.g. {stuck[:6]}"
        )
    return tasks, preds, order


def check_deadlock_free(schedule: Schedule) -> None:
    """Raise ValueError unless every task can run: the graph of dependencies plus in-order stream
    queues (a collective waits for its predecessor on every queue it sits in) has no cycle."""
    _topological_order(schedule)


def simulate_schedule(
    schedule: Schedule, durations: Mapping[str, float] | Callable[[Task], float]
) -> dict[str, tuple[float, float]]:
    """Discrete-event run of ``schedule``: task id -> (start, end) in seconds.

    Streams execute in order, one task at a time; a task starts when all its dependencies have
    ended and it is at the head of every queue it sits in. No other resource is modelled, so the
    start time is exactly the latest end among its predecessors (a longest path in a DAG).
    ``durations``: by task id, or a function of the task.
    """
    tasks, preds, order = _topological_order(schedule)
    duration_of = durations if callable(durations) else (lambda task: durations[task.id])
    return _longest_paths(tasks, preds, order, duration_of)


def _longest_paths(
    tasks: dict[str, Task], preds: dict[str, list[str]], order: list[str], duration_of: Callable[[Task], float]
) -> dict[str, tuple[float, float]]:
    times: dict[str, tuple[float, float]] = {}
    for t in order:
        start = max((times[p][1] for p in preds[t]), default=0.0)
        d = float(duration_of(tasks[t]))
        if not d >= 0:
            raise ValueError(f"duration of {t} must be >= 0 s, got {d!r}")
        times[t] = (start, start + d)
    return times
