"""ep vs fssdp in one benchmark run: the same training on local CPU ranks, one table (and JSON).

    python tools/bench_fssdp.py                       # 4 ranks, 30 iterations each
    python tools/bench_fssdp.py --nproc 4 --iters 50 -- --num-experts 16 --moe-router-topk 1
    python tools/bench_fssdp.py --nproc 8 --nodes 2 --json bench.json   # 2 emulated nodes x 4

Both modes train the same model on the same data with the same seed (everything after `--` is
passed to every run). The skew is the router's own on real text: the embedded Austen corpus, no
auxiliary load-balancing loss (tiny's default), so the gate concentrates tokens on a few
experts within a few iterations, as recorded by ep's imbalance column. Experts are widened
(--moe-ffn-hidden-size 1024 by default) so that they, not the 50k-token output layer, are
the larger share of the compute, as in the published models.

`--nodes N` emulates N nodes of nproc / N ranks on this machine (one torchrun per node, each
with its own SLURMD_NODENAME, which the runtime's node detection reads as on Slurm) and adds a
third run, fssdp with `--fssdp-collectives flat`, beside the default node-aware one: the table
gives both runs' inter- and intra-node spAG + spRS bytes and their ratio.

Printed per MoE layer (means over the iterations after the first `--skip`): max device
tokens and imbalance (max / mean device tokens) under ep and after fssdp's placement, expert
copies; per run: all-to-all, spAG, spRS bytes per iteration (inter / intra node), the bytes of
one copy against an fp32 copy (with `-- --bf16` or `-- --fp16` the copies move half: the
half-precision saving), exposed (waited-for) time of the sparse collectives, mean iteration
time, and the iteration-time ratio fssdp / ep. The losses are compared with ep's as a sanity
check (fp32, no dropout: they agree to 1e-5; in bf16 they differ at the scale of bf16 rounding,
~1e-4). `--json PATH` writes the same figures as one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from megatron_patches.training.arguments import EMBEDDED_JOB

REPO = Path(__file__).resolve().parents[1]
# The tiny job named explicitly: the runs change its size (the entry point loads it by itself only without size flags).
EMBEDDED_JOB_FLAGS = [f"--config={path}" for path in EMBEDDED_JOB]
DEFAULT_FLAGS = ["--moe-ffn-hidden-size", "1024", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "100000"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4, help="local ranks in all (EP = FSSDP group = all of them)")
    parser.add_argument("--nodes", type=int, default=1,
                        help="emulated nodes (each nproc / nodes ranks); > 1 adds a flat-collective fssdp run")
    parser.add_argument("--iters", type=int, default=30, help="training iterations per mode")
    parser.add_argument("--skip", type=int, default=5, help="first iterations left out of the means (warm-up, auto t)")
    parser.add_argument("--fssdp-flags", default="", help="extra flags for the fssdp runs only, e.g. '--fssdp-rematerialize'")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    parser.add_argument("flags", nargs="*", help="flags for every run (after --)")
    args = parser.parse_args(argv)
    for name in ("nproc", "iters", "nodes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: must be >= 1")
    if args.nproc % args.nodes:
        parser.error(f"--nodes={args.nodes}: must divide --nproc={args.nproc} (the same ranks on every node)")
    if not 0 <= args.skip < args.iters:
        parser.error(f"--skip={args.skip}: must be in [0, --iters={args.iters})")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json={args.json}: its directory does not exist")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(name: str, mode: str, args, workdir: Path, extra: list[str]) -> list[dict]:
    """One training run on nproc local ranks over `args.nodes` emulated nodes; its records."""
    log = workdir / f"{name}.jsonl"
    script = [str(REPO / "pretrain_gpt_moe.py"), *EMBEDDED_JOB_FLAGS, "--cpu", "--moe-parallel-mode", mode, "--train-iters", str(args.iters),
              "--log-interval", "1", "--log-json", str(log), *DEFAULT_FLAGS, *args.flags, *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if args.nodes == 1:
        launches = [(["--standalone", f"--nproc-per-node={args.nproc}"], env)]
    else:
        port = free_port()
        launches = [([f"--nnodes={args.nodes}", f"--node-rank={n}", f"--nproc-per-node={args.nproc // args.nodes}",
                      "--master-addr=127.0.0.1", f"--master-port={port}"], dict(env, SLURMD_NODENAME=f"node{n}"))
                    for n in range(args.nodes)]
    print(f"[bench] {name}: {args.nodes} x torchrun {' '.join(launches[0][0][1:])} {' '.join(script)}", flush=True)
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *flags, *script], cwd=REPO, env=node_env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for flags, node_env in launches]
    outputs = [p.communicate()[0] for p in procs]
    failed = [n for n, p in enumerate(procs) if p.returncode != 0]
    if failed:
        sys.exit(f"[bench] {name} run failed (node {failed[0]}, exit {procs[failed[0]].returncode}):\n"
                 f"{outputs[failed[0]][-4000:]}")
    return [r for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]


def spag_per_copy(fssdp: list[dict]) -> str:
    """The measured spAG bytes per copy against what the same copy would move in fp32."""
    copies = sum(sum(sum(layer["copies"]) for layer in r["fssdp"]["layers"]) for r in fssdp)
    moved = sum(sum(r["fssdp"]["bytes"]["spag"].values()) for r in fssdp)
    elements, expert_bytes = fssdp[-1]["fssdp"]["expert_elements"], fssdp[-1]["fssdp"]["expert_bytes"]
    fp32 = 4 * elements
    measured = f"{moved / copies:,.0f} B measured" if copies else "no copies gathered"
    return (f"  spAG per copy              {expert_bytes:,} B ({elements:,} elements x {expert_bytes // elements} B; "
            f"{measured}); in fp32 {fp32:,} B: {1 - expert_bytes / fp32:.0%} saved")


def figures(ep: list[dict], runs: dict[str, list[dict]]) -> dict:
    """The benchmark's figures (means per iteration over the records given) as plain numbers."""
    t_ep = float(np.mean([r["iteration_time_s"] for r in ep]))
    out = {"ep": {"iteration_s": t_ep, "a2a_bytes": float(np.mean([r["bytes"]["a2a"] for r in ep])),
                  "imbalance": [float(np.mean([r["moe_layers"][i]["imbalance"] for r in ep]))
                                for i in range(len(ep[0]["moe_layers"]))]}}
    for name, records in runs.items():
        t = float(np.mean([r["iteration_time_s"] for r in records]))
        out[name] = {
            "iteration_s": t,
            "ratio_to_ep": t / t_ep,
            "a2a_bytes": float(np.mean([r["bytes"]["a2a"] for r in records])),
            **{f"{kind}_{link}_bytes": float(np.mean([r["fssdp"]["bytes"][kind][link] for r in records]))
               for kind in ("spag", "sprs") for link in ("intra", "inter")},
            "imbalance": [float(np.mean([r["fssdp"]["layers"][i]["imbalance"] for r in records]))
                          for i in range(len(records[0]["fssdp"]["layers"]))],
            "copies": [float(np.mean([sum(r["fssdp"]["layers"][i]["copies"]) for r in records]))
                       for i in range(len(records[0]["fssdp"]["layers"]))],
            "exposed_ms": {k: float(np.mean([r["fssdp"]["exposed_s"][k] for r in records])) * 1e3
                           for k in records[0]["fssdp"]["exposed_s"]},
            "t": records[-1]["fssdp"]["t"], "m": records[-1]["fssdp"]["m"],
            "max_loss_difference": max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(records, ep)),
        }
    if "fssdp_flat" in out:
        flat, node_aware = (out[k]["spag_inter_bytes"] + out[k]["sprs_inter_bytes"] for k in ("fssdp_flat", "fssdp"))
        out["inter_node_bytes_hierarchical_over_flat"] = node_aware / flat if flat else None
    return out


def summarize(ep: list[dict], runs: dict[str, list[dict]], figs: dict) -> str:
    fssdp = runs["fssdp"]
    lines = ["", "per MoE layer (means over iterations; fssdp = the default, node-aware collectives)",
             f"{'layer':>5} | {'ep max dev tok':>14} {'ep imbal':>8} | {'fssdp max dev tok':>17} {'fssdp imbal':>11} {'copies':>6}"]
    for i, layer in enumerate(ep[0]["moe_layers"]):
        ep_max = np.mean([max(r["moe_layers"][i]["device_tokens"]) for r in ep])
        fs_max = np.mean([max(r["fssdp"]["layers"][i]["device_tokens"]) for r in fssdp])
        lines.append(f"{layer['layer']:>5} | {ep_max:>14.0f} {figs['ep']['imbalance'][i]:>8.3f} | {fs_max:>17.0f} "
                     f"{figs['fssdp']['imbalance'][i]:>11.3f} {figs['fssdp']['copies'][i]:>6.1f}")
    mib = 2**20
    lines += ["", "per iteration (means)",
              f"  {'run':<12} {'a2a MiB':>8} {'spAG inter/intra MiB':>21} {'spRS inter/intra MiB':>21} {'ms/iter':>8} "
              f"{'/ ep':>6} {'loss diff':>9}",
              f"  {'ep':<12} {figs['ep']['a2a_bytes'] / mib:>8.2f} {'':>21} {'':>21} {figs['ep']['iteration_s'] * 1e3:>8.1f}"]
    for name in runs:
        f = figs[name]
        lines.append(
            f"  {name:<12} {f['a2a_bytes'] / mib:>8.2f} {f['spag_inter_bytes'] / mib:>10.2f}/{f['spag_intra_bytes'] / mib:<10.2f}"
            f" {f['sprs_inter_bytes'] / mib:>10.2f}/{f['sprs_intra_bytes'] / mib:<10.2f} {f['iteration_s'] * 1e3:>8.1f}"
            f" {f['ratio_to_ep']:>6.3f} {f['max_loss_difference']:>9.1e}")
    lines += [
        spag_per_copy(fssdp),
        "  exposed waits (max rank)   " + ", ".join(f"{k} {v:.2f} ms" for k, v in figs["fssdp"]["exposed_ms"].items()),
        f"  overlap degree t, m        {figs['fssdp']['t']}, {figs['fssdp']['m']}",
        "  losses: max relative difference to ep (same model: fp32 runs agree to 1e-5, bf16 runs to bf16 rounding, ~1e-4)",
    ]
    ratio = figs.get("inter_node_bytes_hierarchical_over_flat")
    if "fssdp_flat" in figs:
        lines.append(f"  inter-node spAG + spRS bytes, hierarchical / flat: {'n/a (flat moved none)' if ratio is None else f'{ratio:.3f}'}")
        planned = {name: (figs[name]["t"], figs[name]["m"]) for name in ("fssdp", "fssdp_flat")}
        if len(set(planned.values())) > 1:
            lines.append(f"  note: the two fssdp runs planned with different (t, m) {planned} (auto t and m are measured per run), "
                         "so their bytes compare different copies; fix them with --fssdp-flags "
                         "'--fssdp-overlap-degree T --fssdp-memory-capacity M'")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    fssdp_flags = args.fssdp_flags.split()
    with tempfile.TemporaryDirectory(prefix="bench_fssdp_") as tmp:
        ep = train("ep", "ep", args, Path(tmp), [])
        runs = {"fssdp": train("fssdp", "fssdp", args, Path(tmp), fssdp_flags)}
        if args.nodes > 1:
            runs["fssdp_flat"] = train("fssdp_flat", "fssdp", args, Path(tmp), [*fssdp_flags, "--fssdp-collectives", "flat"])
    ep, runs = ep[args.skip:], {name: records[args.skip:] for name, records in runs.items()}
    figs = figures(ep, runs)
    print(summarize(ep, runs, figs))
    if args.json is not None:
        args.json.write_text(json.dumps({"nproc": args.nproc, "nodes": args.nodes, "iters": args.iters, "skip": args.skip,
                                         "flags": args.flags, "fssdp_flags": fssdp_flags, "runs": figs}, indent=1))
        print(f"[bench] wrote {args.json}")


if __name__ == "__main__":
    main()
