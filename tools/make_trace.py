#!/usr/bin/env python
"""Write a synthetic expert-load trace (.npz) for the plan CLI, the simulator and the plots.

Example (a skewed, drifting trace for 4 nodes x 8 GPUs):

    python tools/make_trace.py --iterations 300 --layers 12 --experts 64 --tokens 65536 \\
        --zipf 1.2 --drift 0.05 --spike-prob 0.02 --ranks 32 --out traces/skewed.npz

The generator model is described in megatron_patches/placement/synthetic.py. `--papers-routing`
starts from the routing dynamics the MoE papers report (`PAPERS_ROUTING` there: fast popularity
swings, layers that differ); flags given beside it override its values. The tool prints the
trace's statistics (megatron_patches/placement/trace.py, `trace_statistics`).
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_patches.placement.synthetic import PAPERS_ROUTING, describe_routing, synthetic_trace
from megatron_patches.placement.trace import TraceError, trace_statistics, write_trace
from megatron_patches.placement.types import PlacementError


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output .npz path")
    parser.add_argument("--iterations", type=int, default=200, help="iterations in the trace (default 200)")
    parser.add_argument("--layers", type=int, default=12, help="MoE layers (default 12)")
    parser.add_argument("--experts", type=int, default=64, help="experts per layer (default 64)")
    parser.add_argument("--tokens", type=int, default=65536,
                        help="routed tokens per layer and iteration, i.e. batch tokens x top-k (default 65536)")
    parser.add_argument("--papers-routing", action="store_true",
                        help="start from the papers' routing dynamics (synthetic.PAPERS_ROUTING: "
                        + describe_routing(PAPERS_ROUTING) + ")")
    parser.add_argument("--zipf", type=float, default=None, help="Zipf exponent of popularity; 0 = uniform (default 1.0)")
    parser.add_argument("--drift", type=float, default=None,
                        help="popularity positions moved per iteration; 0 = static hot experts (default 0.05)")
    parser.add_argument("--spike-prob", type=float, default=0.0,
                        help="probability of a one-iteration spike per (iteration, layer) (default 0)")
    parser.add_argument("--spike-factor", type=float, default=5.0, help="weight multiplier of a spike (default 5)")
    parser.add_argument("--layer-variation", type=float, default=None,
                        help="relative spread of the Zipf exponent across layers, 0..1 (default 0.2)")
    parser.add_argument("--swing", type=float, default=None,
                        help="std-dev of an expert's log-popularity around its Zipf weight, a random walk over "
                        "iterations (default 0: no swings)")
    parser.add_argument("--swing-corr", type=float, default=None,
                        help="correlation of that log-popularity between consecutive iterations, 0..1 (default 0.9)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="also write source_loads split over this many ranks (default: none)")
    parser.add_argument("--source-noise", type=float, default=0.1,
                        help="per-rank log-normal perturbation of the routing distribution (default 0.1)")
    parser.add_argument("--topk", type=int, default=None,
                        help="experts per token: no expert gets more than 1/topk of the routed tokens (default 1)")
    parser.add_argument("--model", default=None, help="model name recorded in the metadata only")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    metadata = {} if args.model is None else {"model": args.model}
    routing = dict(PAPERS_ROUTING) if args.papers_routing else {}
    routing.update({name: getattr(args, name) for name in ("zipf", "drift", "layer_variation", "swing", "swing_corr")
                    if getattr(args, name) is not None})
    try:
        trace = synthetic_trace(
            iterations=args.iterations,
            layers=args.layers,
            experts=args.experts,
            tokens=args.tokens,
            spike_prob=args.spike_prob,
            spike_factor=args.spike_factor,
            **routing,
            topk=args.topk or 1,
            ranks=args.ranks,
            source_noise=args.source_noise,
            seed=args.seed,
            **metadata,
        )
    except PlacementError as err:
        print(f"make_trace: {err}", file=sys.stderr)
        return 2
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    write_trace(args.out, trace.loads, trace.source_loads, **trace.metadata)
    print(
        f"wrote {args.out}: loads {trace.loads.shape}"
        + ("" if trace.source_loads is None else f", source_loads {trace.source_loads.shape}")
        + f" (a uniform share would be {1 / trace.num_experts:.1%})"
    )
    try:
        print(f"statistics: {trace_statistics(trace.loads).describe()}")
    except TraceError as err:
        print(f"statistics: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
