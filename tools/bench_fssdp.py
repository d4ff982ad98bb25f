"""ep vs fssdp in one benchmark run: the same training twice on local CPU ranks, one table.

    python tools/bench_fssdp.py                       # 4 ranks, 30 iterations each
    python tools/bench_fssdp.py --nproc 4 --iters 50 -- --num-experts 16 --moe-router-topk 1

Both runs train the same model on the same data with the same seed (everything after `--` is
passed to both). The skew is the router's own on real text: the embedded Austen corpus, no
auxiliary load-balancing loss (tiny's default), so the gate concentrates tokens on a few
experts within a few iterations, as recorded by ep's imbalance column. Experts are widened
(--moe-ffn-hidden-size 1024 by default) so that they, not the 50k-token output layer, are
the larger share of the compute, as in the published models.

Printed per MoE layer (means over the iterations after the first `--skip`): max device
tokens and imbalance (max / mean device tokens) under ep and after fssdp's placement, expert
copies; per run: all-to-all, spAG, spRS bytes per iteration, the bytes of one copy against an
fp32 copy (with `-- --bf16` or `-- --fp16` the copies move half: the half-precision saving),
exposed (waited-for) time of the sparse collectives, mean iteration time, and the
iteration-time ratio fssdp / ep. The losses of both runs are compared as a sanity check (fp32,
no dropout: they agree to 1e-5; in bf16 they differ at the scale of bf16 rounding, ~1e-4).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FLAGS = ["--moe-ffn-hidden-size", "1024", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "100000"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4, help="local ranks (EP = FSSDP group = all of them)")
    parser.add_argument("--iters", type=int, default=30, help="training iterations per mode")
    parser.add_argument("--skip", type=int, default=5, help="first iterations left out of the means (warm-up, auto t)")
    parser.add_argument("--fssdp-flags", default="", help="extra flags for the fssdp run only, e.g. '--fssdp-rematerialize'")
    parser.add_argument("flags", nargs="*", help="flags for both runs (after --)")
    args = parser.parse_args(argv)
    for name in ("nproc", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: must be >= 1")
    if not 0 <= args.skip < args.iters:
        parser.error(f"--skip={args.skip}: must be in [0, --iters={args.iters})")
    return args


def train(mode: str, args, workdir: Path, extra: list[str]) -> list[dict]:
    log = workdir / f"{mode}.jsonl"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
        str(REPO / "pretrain_gpt_moe.py"), "--cpu", "--moe-parallel-mode", mode, "--train-iters", str(args.iters),
        "--log-interval", "1", "--log-json", str(log), *DEFAULT_FLAGS, *args.flags, *extra,
    ]
    print(f"[bench] {mode}: {' '.join(cmd[3:])}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"[bench] {mode} run failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
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


def summarize(ep: list[dict], fssdp: list[dict], skip: int) -> str:
    ep, fssdp = ep[skip:], fssdp[skip:]
    lines = ["", "per MoE layer (means over iterations)",
             f"{'layer':>5} | {'ep max dev tok':>14} {'ep imbal':>8} | {'fssdp max dev tok':>17} {'fssdp imbal':>11} {'copies':>6}"]
    for i, layer in enumerate(ep[0]["moe_layers"]):
        ep_max = np.mean([max(r["moe_layers"][i]["device_tokens"]) for r in ep])
        ep_imb = np.mean([r["moe_layers"][i]["imbalance"] for r in ep])
        fs_max = np.mean([max(r["fssdp"]["layers"][i]["device_tokens"]) for r in fssdp])
        fs_imb = np.mean([r["fssdp"]["layers"][i]["imbalance"] for r in fssdp])
        copies = np.mean([sum(r["fssdp"]["layers"][i]["copies"]) for r in fssdp])
        lines.append(f"{layer['layer']:>5} | {ep_max:>14.0f} {ep_imb:>8.3f} | {fs_max:>17.0f} {fs_imb:>11.3f} {copies:>6.1f}")

    def mib(records, key):
        return np.mean([key(r) for r in records]) / 2**20

    t_ep = np.mean([r["iteration_time_s"] for r in ep])
    t_fs = np.mean([r["iteration_time_s"] for r in fssdp])
    exposed = {k: np.mean([r["fssdp"]["exposed_s"][k] for r in fssdp]) * 1e3 for k in fssdp[0]["fssdp"]["exposed_s"]}
    lines += [
        "",
        "per iteration (means)",
        f"  all-to-all bytes (model)   ep {mib(ep, lambda r: r['bytes']['a2a']):8.2f} MiB   fssdp {mib(fssdp, lambda r: r['bytes']['a2a']):8.2f} MiB",
        f"  spAG / spRS bytes          fssdp {mib(fssdp, lambda r: sum(r['fssdp']['bytes']['spag'].values())):8.2f} / "
        f"{mib(fssdp, lambda r: sum(r['fssdp']['bytes']['sprs'].values())):8.2f} MiB",
        spag_per_copy(fssdp),
        "  exposed waits (max rank)   " + ", ".join(f"{k} {v:.2f} ms" for k, v in exposed.items()),
        f"  overlap degree t, m        {fssdp[-1]['fssdp']['t']}, {fssdp[-1]['fssdp']['m']}",
        f"  iteration time             ep {t_ep * 1e3:8.1f} ms   fssdp {t_fs * 1e3:8.1f} ms   ratio fssdp/ep {t_fs / t_ep:.3f}",
    ]
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(fssdp, ep))
    lines.append(f"  losses                     max relative difference {worst:.2e} (same model: fp32 runs agree to 1e-5, "
                 "bf16 runs to bf16 rounding, ~1e-4)")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_fssdp_") as tmp:
        ep = train("ep", args, Path(tmp), [])
        fssdp = train("fssdp", args, Path(tmp), args.fssdp_flags.split())
    print(summarize(ep, fssdp, args.skip))


if __name__ == "__main__":
    main()
