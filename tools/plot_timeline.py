#!/usr/bin/env python
"""Draw a zebra timeline (--zebra-timeline FILE) as a Gantt chart and print bubble fractions.

One row per (rank, stream): compute tasks coloured by kind and phase (attention forward/backward,
experts forward/backward), all-to-alls in grey; each bar is labelled with its micro-batch. The
printed bubble fraction of a rank is the idle share of its compute stream over the iteration's
span (first start to last end over all ranks), as ``zebra.timeline.bubble_fractions`` defines it.

    python tools/plot_timeline.py z_timeline.json --out z_timeline.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from megatron_patches.zebra.timeline import bubble_fractions, read_timeline

COLOURS = {"A_F": "#4C72B0", "A_B": "#8FAADC", "E_F": "#DD8452", "E_B": "#F4B183", "D": "#7F7F7F", "C": "#BFBFBF"}
LEGEND = {"A_F": "attention forward", "A_B": "attention backward", "E_F": "experts forward",
          "E_B": "experts backward", "D": "dispatch all-to-all", "C": "combine all-to-all"}
STREAMS = ("compute", "dispatch", "combine")


def colour_key(label: str) -> str:
    """"A_F(1,0)" -> "A_F"; all-to-alls by kind only."""
    kind = label.split("(")[0]
    return kind if kind[0] in "AE" else kind[0]


def plot(timeline: dict, out: Path) -> None:
    rows = [(r, stream) for r in timeline["ranks"] for stream in STREAMS]
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.5))
    origin = min(t["start"] for r in timeline["ranks"] for t in r["tasks"])
    for y, (rank, stream) in enumerate(rows):
        for task in (t for t in rank["tasks"] if t["stream"] == stream):
            start, width = (task["start"] - origin) * 1e3, (task["end"] - task["start"]) * 1e3
            ax.barh(y, width, left=start, height=0.8, color=COLOURS[colour_key(task["task"])], edgecolor="black",
                    linewidth=0.3)
            if stream == "compute":
                microbatch = task["task"].split(",")[1].rstrip(")")
                ax.text(start + width / 2, y, microbatch, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r['rank']} ({r['role'][:3]}) {stream}" for r, stream in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the iteration started")
    ax.set_title(
        f"zebra timeline: M={timeline['attention_ranks']} N={timeline['expert_ranks']} "
        f"R={timeline['microbatches']} L={timeline['num_layers']} offload {timeline['offload_chunks']} "
        f"({timeline['device']})"
    )
    ax.legend(handles=[Patch(color=COLOURS[k], label=v) for k, v in LEGEND.items()], fontsize=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=6)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", type=Path, help="JSON file written by --zebra-timeline")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: next to the timeline)")
    args = parser.parse_args(argv)
    timeline = read_timeline(args.timeline)
    out = args.out or args.timeline.with_suffix(".png")
    plot(timeline, out)
    bubbles = bubble_fractions(timeline)
    for rank in timeline["ranks"]:
        print(f"rank {rank['rank']} ({rank['role']}): compute bubble {bubbles[rank['rank']]:.1%}")
    for role in ("attention", "expert"):
        values = [bubbles[r["rank"]] for r in timeline["ranks"] if r["role"] == role]
        print(f"{role} ranks: mean compute bubble {sum(values) / len(values):.1%}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
