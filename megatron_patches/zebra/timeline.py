"""Zebra timeline: when every task of one iteration ran, per rank and stream (--zebra-timeline).

Each rank records, per stream ("compute", "dispatch", "combine"), the tasks in the order it
executed them with their start and end in seconds since the iteration started (all ranks start
the clock right after a barrier, so times of different ranks are comparable up to the barrier's
skew). ``gather_timeline`` collects every rank's record on rank 0 and ``write_timeline`` stores
the JSON file that ``tools/plot_timeline.py`` draws:

    {"format": "zebra-timeline/1", "num_layers": L, "microbatches": R, "attention_ranks": M,
     "expert_ranks": N, "offload_chunks": [...], "device": "cpu" | "cuda",
     "ranks": [{"rank": 0, "role": "attention", "zp_group": 0,
                "tasks": [{"stream": "compute", "task": "A_F(0,0)", "start": 0.0, "end": 0.01}, ...]}]}

Times: on CPU, host clock around each compute call and from a collective's launch to the moment
its completion was seen; on GPU, CUDA events on the stream that ran the task.

``bubble_fractions`` is the idle share of each rank's compute stream over the iteration's span
(first start to last end over all ranks): 0 means the stream never waited.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_patches.placement.zebra import STREAMS

__all__ = ["TIMELINE_FORMAT", "TaskSpan", "RankTimeline", "bubble_fractions", "gather_timeline",
           "read_timeline", "write_timeline"]

TIMELINE_FORMAT = "zebra-timeline/1"


@dataclass(frozen=True)
class TaskSpan:
    """One executed task."""

    stream: str
    """"compute", "dispatch" or "combine"."""
    task: str
    """The task's role-free label, e.g. "A_F(1,0)" (placement.zebra.Task.label)."""
    start: float
    """Seconds since the iteration started on this rank."""
    end: float
    """Seconds since the iteration started on this rank; >= start."""


@dataclass
class RankTimeline:
    """The tasks one rank executed in one iteration, in execution order per stream."""

    rank: int
    """Global rank."""
    role: str
    """"attention" or "expert"."""
    zp_group: int
    """Index of the rank's ZP group."""
    spans: list[TaskSpan] = field(default_factory=list)
    """Every task, in the order the rank finished them."""

    def executed_order(self, stream: str) -> list[str]:
        """Labels of the tasks of ``stream`` in the order they started."""
        if stream not in STREAMS:
            raise ValueError(f"stream {stream!r} is not one of {STREAMS}")
        ordered = sorted((s for s in self.spans if s.stream == stream), key=lambda s: s.start)
        return [s.task for s in ordered]

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "role": self.role,
            "zp_group": self.zp_group,
            "tasks": [{"stream": s.stream, "task": s.task, "start": s.start, "end": s.end} for s in self.spans],
        }


def gather_timeline(local: RankTimeline, header: dict) -> dict | None:
    """Collective over the default group: every rank's timeline on rank 0 (None elsewhere)."""
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local.to_dict(), gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    return {"format": TIMELINE_FORMAT, **header, "ranks": sorted(gathered, key=lambda r: r["rank"])}


def write_timeline(path: str | os.PathLike, timeline: dict) -> None:
    """Write a gathered timeline (rank 0's result of gather_timeline) as JSON."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
        json.dump(timeline, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def read_timeline(path: str | os.PathLike) -> dict:
    with open(path) as f:
        data = json.load(f)
    if data.get("format") != TIMELINE_FORMAT:
        raise ValueError(f"{path}: format is {data.get('format')!r}, expected {TIMELINE_FORMAT!r}")
    return data


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of the intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def bubble_fractions(timeline: dict, stream: str = "compute") -> dict[int, float]:
    """Per rank: 1 - busy time of ``stream`` / the iteration's span over all ranks."""
    spans = [t for r in timeline["ranks"] for t in r["tasks"]]
    if not spans:
        raise ValueError("the timeline holds no tasks")
    first = min(t["start"] for t in spans)
    last = max(t["end"] for t in spans)
    span = last - first
    if span <= 0:
        raise ValueError(f"the timeline spans {span} s; nothing to measure")
    return {
        r["rank"]: 1.0 - _busy([(t["start"], t["end"]) for t in r["tasks"] if t["stream"] == stream]) / span
        for r in timeline["ranks"]
    }
