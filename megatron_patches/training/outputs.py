"""Where a run writes: the run folder (`--run-dir`) and the checks on every output path.

With `--run-dir DIR` a run keeps everything a person reads afterwards in one folder, under the
names the Slurm jobs use (launch/submit.py):

    DIR/arguments.txt      every flag value (stdout gets a short summary instead)
    DIR/metrics.jsonl      --log-json
    DIR/tensorboard/       --tensorboard-dir
    DIR/loads.npz          --moe-log-loads (modes that run the shared loop)
    DIR/loss_imbalance.png the loss and the worst layer's imbalance per logged iteration (ep's and the placed one)

An explicit --log-json, --tensorboard-dir or --moe-log-loads wins over the folder's name.
`launch/local.sh` passes `--run-dir runs/local-<time>`.

Every output path is checked before any process group starts (`check_outputs`): a path that
cannot be written would otherwise fail after training (the load trace is written last).
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_patches.config.flags import fail

ARGUMENTS = "arguments.txt"
PLOT = "loss_imbalance.png"
# dest -> (name inside the run folder, is a directory)
RUN_FILES = {
    "log_json": ("metrics.jsonl", False),
    "tensorboard_dir": ("tensorboard", True),
    "moe_log_loads": ("loads.npz", False),
}


def apply_run_dir(args) -> None:
    """Fill the unset output flags from --run-dir."""
    if not args.run_dir:
        return
    for dest, (name, _) in RUN_FILES.items():
        if getattr(args, dest) is None:
            setattr(args, dest, str(Path(args.run_dir) / name))


def _check_writable(flag: str, path: Path, is_dir: bool) -> None:
    """`path` can be created (or overwritten) as a file or directory by this process."""
    if path.exists():
        if is_dir != path.is_dir():
            fail(flag, path, f"exists and is {'not ' if is_dir else ''}a directory; valid: a "
                 f"{'directory' if is_dir else 'file'} path")
        if not os.access(path, os.W_OK):
            fail(flag, path, "exists but is not writable by this user")
        return
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        fail(flag, path, f"{parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        fail(flag, path, f"cannot be created: {parent} is not writable by this user")


def check_outputs(args) -> None:
    """Every output path (run folder, JSONL, TensorBoard, load trace, dataset index cache) is writable."""
    outputs = [("--run-dir", args.run_dir, True), ("--data-cache-path", args.data_cache_path, True)]
    outputs += [(f"--{dest.replace('_', '-')}", getattr(args, dest), is_dir) for dest, (_, is_dir) in RUN_FILES.items()]
    for flag, value, is_dir in outputs:
        if value:
            _check_writable(flag, Path(value), is_dir)


def write_arguments(run_dir: str, text: str) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / ARGUMENTS).write_text(text + "\n")


def plot_run(records: list[dict], path: Path) -> None:
    """Training loss (and evaluation loss) over the top panel, the worst MoE layer's imbalance
    below, from the run's metrics records: with placement, ep's on the same routing (the owners'
    layout) beside the placed one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def finite(value) -> float:
        return float("nan") if value is None else value  # strict JSONL writes NaN and inf as null

    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    fig, (loss_ax, imbalance_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    loss_ax.plot([r["iteration"] for r in train], [finite(r["loss"]) for r in train], label="train", linewidth=1)
    if evals:
        loss_ax.plot([r["iteration"] for r in evals], [finite(r["eval_loss"]) for r in evals], "o", label="eval")
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    placing = any("placed" in r.get("balance", {}) for r in train)
    for layout, color in (("owners", "black"), ("placed", "tab:orange")):
        shown = [(r["iteration"], r["balance"][layout]) for r in train if layout in r.get("balance", {})]
        if shown:
            label = shown[0][1]["label"] + (" (same routing)" if layout == "owners" and placing else "")
            imbalance_ax.plot([i for i, _ in shown], [b["imbalance"] for _, b in shown], linewidth=1, color=color,
                              label=label)
    imbalance_ax.axhline(1.0, color="grey", linewidth=0.5)
    imbalance_ax.legend()
    imbalance_ax.set_ylabel("imbalance = max / mean\ntokens per rank (max layer)")
    imbalance_ax.set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
