"""Zebra mode settings from the command line (`--zebra-*`), validated before any process group.

``add_zebra_args(parser)`` adds the flags (the training script's parser calls it);
``ZebraConfig.from_args(args)`` reads them. Every refusal raises ``ZebraConfigError`` naming the
flag, the value and what would be valid.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

__all__ = ["ZebraConfig", "ZebraConfigError", "add_zebra_args", "parse_asym_ea"]


class ZebraConfigError(ValueError):
    """A --zebra-* value that cannot run; the message names the flag, the value and what is valid."""


def parse_asym_ea(value) -> str | tuple[int, ...]:
    """--zebra-asym-ea: "auto", "off", or chunks per layer ("0,1,1,0" or a sequence of ints >= 0)."""
    if isinstance(value, str):
        text = value.strip()
        if text in ("auto", "off"):
            return text
        try:
            chunks = tuple(int(item) for item in text.split(","))
        except ValueError:
            raise ZebraConfigError(
                f"--zebra-asym-ea={value!r} is invalid; valid: auto, off, or comma-separated chunks per "
                "layer such as 0,1,1,0"
            ) from None
    else:
        chunks = tuple(value)
        if any(isinstance(c, bool) or not isinstance(c, int) for c in chunks):
            raise ZebraConfigError(f"--zebra-asym-ea={value!r} is invalid; list entries must be integers")
    negative = [c for c in chunks if c < 0]
    if negative or not chunks:
        raise ZebraConfigError(
            f"--zebra-asym-ea={value!r} is invalid; chunks per layer must be integers >= 0, one per layer"
        )
    return chunks


@dataclass(frozen=True)
class ZebraConfig:
    """How a zebra run splits each ZP group and schedules micro-batches (DESIGN 4.7, 4.8)."""

    attention_ranks: int
    """M (--zebra-attention-ranks): ranks per ZP group that run embeddings, attention, gate, norms
    and the head (data-parallel over all attention ranks of all ZP groups)."""
    expert_ranks: int
    """N (--zebra-expert-ranks): ranks per ZP group that hold the experts of every layer
    (expert-parallel inside the group); must divide the experts per layer."""
    microbatches: int
    """R (--zebra-microbatches): micro-batches per attention rank and iteration; they zig-zag
    between attention and expert ranks so that both compute at once."""
    asym_ea: str | tuple[int, ...] = "off"
    """--zebra-asym-ea: "off", "auto" (gather and squeeze from --zebra-profile), or the chunks of
    experts each layer moves from the expert ranks to the attention ranks."""
    profile: str | None = None
    """--zebra-profile: the profile file of tools/profile_moe.py (needed by auto; with off or a
    list its memory bounds are checked)."""
    timeline: str | None = None
    """--zebra-timeline: JSON file that receives every task's start and end per rank and stream
    (tools/plot_timeline.py draws it); None records nothing."""
    cluster: str | None = None
    """--zebra-cluster: the cluster config (name under configs/clusters or a YAML path) whose
    node groups are the pools (attention GPU type first); None = this machine, one pool of
    identical devices (``zebra.pools.local_pool``)."""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--zebra-attention-ranks", self.attention_ranks),
            ("--zebra-expert-ranks", self.expert_ranks),
            ("--zebra-microbatches", self.microbatches),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ZebraConfigError(f"{flag}={value!r} is invalid; expected an integer >= 1")
        object.__setattr__(self, "asym_ea", parse_asym_ea(self.asym_ea))
        if self.asym_ea == "auto" and self.profile is None:
            raise ZebraConfigError(
                "--zebra-asym-ea=auto needs --zebra-profile FILE (tools/profile_moe.py writes it); "
                "or give the chunks per layer, or off"
            )
        if self.profile is not None and not os.path.isfile(self.profile):
            raise ZebraConfigError(f"--zebra-profile={self.profile!r}: no such file")
        if self.timeline is not None:
            folder = os.path.dirname(os.path.abspath(self.timeline))
            if not os.path.isdir(folder):
                raise ZebraConfigError(f"--zebra-timeline={self.timeline!r}: the folder {folder} does not exist")

    @property
    def group_size(self) -> int:
        """M + N: ranks per ZP group."""
        return self.attention_ranks + self.expert_ranks

    @classmethod
    def from_args(cls, args) -> "ZebraConfig":
        return cls(
            attention_ranks=args.zebra_attention_ranks,
            expert_ranks=args.zebra_expert_ranks,
            microbatches=args.zebra_microbatches,
            asym_ea=args.zebra_asym_ea,
            profile=args.zebra_profile,
            timeline=args.zebra_timeline,
            cluster=args.zebra_cluster,
        )


def add_zebra_args(parser: argparse.ArgumentParser) -> None:
    """The --zebra-* flags (the training script's parser calls this)."""
    group = parser.add_argument_group(title="zebra (--moe-parallel-mode zebra)")
    group.add_argument(
        "--zebra-attention-ranks", type=int, default=None,
        help="M: attention ranks per ZP group (embeddings, attention, gate, norms, head; data-parallel "
        "over all attention ranks). The first M ranks of every group of M + N consecutive ranks. New flag.",
    )
    group.add_argument(
        "--zebra-expert-ranks", type=int, default=None,
        help="N: expert ranks per ZP group (the experts of every layer, expert-parallel); must divide "
        "--num-experts. New flag.",
    )
    group.add_argument(
        "--zebra-microbatches", type=int, default=None,
        help="R: micro-batches per attention rank and iteration, zig-zagging between attention and "
        "expert ranks. New flag.",
    )
    group.add_argument(
        "--zebra-asym-ea", type=str, default="off",
        help="Asymmetric expert assignment: off, auto (gather and squeeze from --zebra-profile), or "
        "the chunks of experts per layer moved to the attention ranks, e.g. 0,1. Needs M | N or "
        "N | M unless off. New flag.",
    )
    group.add_argument(
        "--zebra-profile", type=str, default=None,
        help="Profile file of tools/profile_moe.py (one entry per GPU type); needed by "
        "--zebra-asym-ea auto, checked against the memory bounds otherwise. New flag.",
    )
    group.add_argument(
        "--zebra-cluster", type=str, default=None,
        help="Cluster config of the pool (a name under configs/clusters, e.g. zebra_o1, or a YAML "
        "path): its node groups give each rank's GPU type (attention type first), checked against "
        "the roles and looked up in --zebra-profile. Default: this machine as one pool of identical "
        "devices (configs/clusters/local_cpu.yaml widened to the world size). New flag.",
    )
    group.add_argument(
        "--zebra-timeline", type=str, default=None,
        help="Write every task's start and end per rank and stream of the last iteration to this "
        "JSON file (tools/plot_timeline.py draws it). New flag.",
    )
