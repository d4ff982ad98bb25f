"""Per-iteration MoE metrics (docs/design.md section 5) and their sinks: stdout, JSON lines,
TensorBoard and the `.npz` expert-load trace.

Definitions (the same in logs, tests, placement tools and the simulator):
- expert_tokens[e]: token copies routed to expert e in this iteration, summed over all
  ranks and micro-batches (before capacity dropping);
- device_tokens[d]: token copies processed (after dropping) by the experts hosted on EP
  rank d, summed over all expert-data-parallel replicas (with
  --moe-pad-expert-input-to-capacity the padded slots are computed but are no token: not counted);
- imbalance = max(device_tokens) / mean(device_tokens) (1.0 when nothing was routed);
- survival = processed / routed: the routed copies kept by the capacity (1.0 without a capacity
  factor; padding does not raise it);
- bytes["a2a"]: the expert all-to-all payload, counted as rows sent to another rank (ep: the
  expert's EP rank, padded slots included; fssdp, replicate: the holder the dispatch plan chose)
  x hidden x element size, for dispatch and combine, forward and backward (4 transfers per
  remote row), summed over ranks.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state

from megatron_patches.compat import mcore
from megatron_patches.placement.accounting import imbalance as imbalance_of
from megatron_patches.training.model import moe_layers


@dataclass
class IterationLoads:
    """Global MoE loads of one iteration, identical on every rank after `collect()`."""

    routed_LE: np.ndarray
    """int64 [moe layers, experts]: token copies routed per expert (before dropping)."""
    processed_LE: np.ndarray
    """int64 [moe layers, experts]: token copies processed per expert (after dropping)."""
    source_routed_LSE: np.ndarray
    """int64 [moe layers, source ranks of a pipeline stage, experts]: routed per source."""
    remote_copies: int
    """Token copies sent to an expert on another EP rank (all ranks, all layers)."""


class MoELoadRecorder:
    """Counts routed and processed tokens per MoE layer via hooks on Megatron's routers.

    The counts stay on the model's device until `collect()` (once per iteration): a hook that
    read them back to the host would wait, on a GPU, for all the work queued before it."""

    def __init__(self, model_chunks, moe_layer_numbers: list[int], num_experts: int, ep_size: int, device: torch.device):
        self.layer_index = {number: i for i, number in enumerate(moe_layer_numbers)}
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        num_layers = len(moe_layer_numbers)
        self.routed_LE = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.processed_LE = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.remote = torch.zeros((), dtype=torch.int64, device=device)
        self.enabled = True
        self.handles = []
        # Experts are laid out contiguously over EP ranks (Megatron's EP).
        per_rank = num_experts // ep_size
        # 1 for the experts another rank owns: a product, not a boolean index, which would read
        # the mask's count on the host (a GPU synchronisation per MoE layer and micro-batch)
        self.remote_E = torch.ones(num_experts, dtype=torch.int64, device=device)
        self.remote_E[self.ep_rank * per_rank : (self.ep_rank + 1) * per_rank] = 0
        for chunk in model_chunks:
            for number, moe_layer in moe_layers(mcore.unwrap(chunk)):
                row = self.layer_index[number]
                self.handles += mcore.observe_routing(
                    moe_layer.router, self._on_routed(row), self._on_processed(row)
                )
        self.stage_source_index, self.sources_per_stage = _stage_source_index()

    def _on_routed(self, row: int):
        def record(routing_map_TE: torch.Tensor) -> None:
            if self.enabled and not mcore.recomputing():  # a recomputed forward routes the same tokens again
                self.routed_LE[row] += routing_map_TE.sum(dim=0).to(torch.int64)

        return record

    def _on_processed(self, row: int):
        def record(kept_TE: torch.Tensor, sent_TE: torch.Tensor) -> None:
            if self.enabled and not mcore.recomputing():
                self.processed_LE[row] += kept_TE.sum(dim=0).to(torch.int64)
                # the all-to-all carries what is sent, padded slots included
                self.remote += (sent_TE.sum(dim=0).to(torch.int64) * self.remote_E).sum()

        return record

    def collect(self) -> IterationLoads:
        """All-gathers this iteration's counts over the world and resets them."""
        world = dist.get_world_size()
        local = torch.cat([self.routed_LE.flatten(), self.processed_LE.flatten(), self.remote.view(1)]).cpu()
        gathered = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        stacked = torch.stack(gathered).numpy()
        n = self.routed_LE.numel()
        layers, experts = self.routed_LE.shape
        routed_WLE = stacked[:, :n].reshape(world, layers, experts)
        processed_WLE = stacked[:, n : 2 * n].reshape(world, layers, experts)
        source_LSE = np.zeros((layers, self.sources_per_stage, experts), dtype=np.int64)
        for rank in range(world):
            source_LSE[:, self.stage_source_index[rank], :] += routed_WLE[rank]
        self.routed_LE.zero_()
        self.processed_LE.zero_()
        self.remote.zero_()
        return IterationLoads(
            routed_LE=routed_WLE.sum(axis=0),
            processed_LE=processed_WLE.sum(axis=0),
            source_routed_LSE=source_LSE,
            remote_copies=int(stacked[:, -1].sum()),
        )


def _stage_source_index() -> tuple[list[int], int]:
    """For every global rank, its position among the ranks of its pipeline stage."""
    pp_ranks = [None] * dist.get_world_size()
    dist.all_gather_object(pp_ranks, parallel_state.get_pipeline_model_parallel_rank())
    seen: dict[int, int] = {}
    index = []
    for pp in pp_ranks:
        index.append(seen.get(pp, 0))
        seen[pp] = seen.get(pp, 0) + 1
    return index, max(seen.values())


def moe_layer_records(loads: IterationLoads, layer_numbers: list[int], owners_LE: np.ndarray) -> list[dict]:
    """Per MoE layer: tokens per expert, tokens per owner position (`owners_LE`: the position of
    each expert's owner within an expert group, ModeRuntime.owner_positions_LE), the imbalance over
    the positions that own an expert (zebra's attention positions own none without Asym-EA) and
    the token survival."""
    positions = int(owners_LE.max()) + 1
    records = []
    for i, number in enumerate(layer_numbers):
        device_D = np.bincount(owners_LE[i], weights=loads.processed_LE[i], minlength=positions).astype(np.int64)
        routed = int(loads.routed_LE[i].sum())
        records.append(
            {
                "layer": number,
                "expert_tokens": loads.routed_LE[i].tolist(),
                "device_tokens": device_D.tolist(),
                "imbalance": float(imbalance_of(device_D[np.unique(owners_LE[i])])),
                "survival": float(loads.processed_LE[i].sum() / routed) if routed else 1.0,
            }
        )
    return records


def balance(owner_layers: list[dict], placed_layers: list[dict] | None, owners_label: str, mode: str) -> dict:
    """One iteration's balance for the progress line, the plot and the summary, per layout: the
    worst layer's imbalance and `busiest_tokens`, the tokens on the busiest rank summed over the
    MoE layers (what the slowest rank computes: the iteration's path through the experts).
    "owners": the common record's layout (`owners_label`: "ep" where that is Megatron's EP
    layout, so the figure is what ep would have had on the same routing); "placed": after the
    mode placed copies by load (`placed_layers`), absent where nothing was placed."""

    def of(layers: list[dict], label: str) -> dict:
        return {
            "label": label,
            "imbalance": max((layer["imbalance"] for layer in layers), default=1.0),
            "busiest_tokens": int(sum(max(layer["device_tokens"], default=0) for layer in layers)),
        }

    placed = {"placed": of(placed_layers, mode)} if placed_layers is not None else {}
    return {"owners": of(owner_layers, owners_label), **placed}


def balance_text(balance: dict) -> str:
    """`imbalance(max layer) 1.31`, or with placement `imbalance(max layer) ep 1.90 -> fssdp 1.05`."""
    owners, placed = balance["owners"], balance.get("placed")
    if placed is None:
        return f"imbalance(max layer) {owners['imbalance']:.2f}"
    return f"imbalance(max layer) {owners['label']} {owners['imbalance']:.2f} -> {placed['label']} {placed['imbalance']:.2f}"


def balance_summary(balances: list[dict]) -> str:
    """The run's balance for the summary line: the worst layer's imbalance as a mean over the
    iterations, and with placement the change in tokens on the busiest rank (summed over the
    iterations), e.g. `imbalance(max layer, mean) ep 1.90 -> fssdp 1.05, tokens on the busiest
    rank -45%`."""
    if not balances:
        return ""
    owners = float(np.mean([b["owners"]["imbalance"] for b in balances]))
    if "placed" not in balances[0]:
        return f"imbalance(max layer, mean) {owners:.2f}"
    placed = float(np.mean([b["placed"]["imbalance"] for b in balances]))
    before = sum(b["owners"]["busiest_tokens"] for b in balances)
    after = sum(b["placed"]["busiest_tokens"] for b in balances)
    change = f"{(after / before - 1) * 100:+.0f}%" if before else "n/a (no tokens)"
    return (f"imbalance(max layer, mean) {balances[0]['owners']['label']} {owners:.2f} -> {balances[0]['placed']['label']} "
            f"{placed:.2f}, tokens on the busiest rank {change}")


def _scaling_text(record: dict) -> str:
    """The loss scale and the skipped steps, where there is loss scaling or a skipped step."""
    if record["loss_scale"] == 1.0 and not record["skipped_iterations"]:
        return ""
    return f"loss scale {record['loss_scale']:g} | skipped {record['skipped_iterations']} | "


def strict_json(record: dict) -> dict:
    """`record` with every NaN and infinity as null (JSON has no such numbers, and strict readers
    such as jq, JavaScript and most languages' parsers reject Python's `NaN`/`Infinity`), plus a
    `non_finite` field naming each replaced value's path and what it was ("loss": "nan",
    "extra.1.1": "inf"), so a reader can tell a non-finite value from a missing one."""
    replaced: dict[str, str] = {}

    def clean(value, path: str):
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            replaced[path] = str(value)
            return None
        if isinstance(value, dict):
            return {key: clean(item, f"{path}.{key}" if path else str(key)) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(item, f"{path}.{i}") for i, item in enumerate(value)]
        return value

    cleaned = clean(record, "")
    if replaced:
        cleaned["non_finite"] = replaced
    return cleaned


ETA_WINDOW = 5
"""Progress lines whose pace the ETA follows."""


def read_records(path: str) -> list[dict]:
    """The records of a JSON-lines metrics file, in order (non-finite numbers read as None)."""
    with open(path) as lines:
        return [json.loads(line) for line in lines if line.strip()]


@dataclass
class MetricsWriter:
    """Rank-0 sinks: a human line on stdout, one JSON object per line, TensorBoard."""

    json_path: str | None
    tensorboard_dir: str | None
    train_iters: int
    validation_ppl: bool = False
    """--log-validation-ppl-to-tensorboard: the evaluation's perplexity as eval/ppl too."""
    tensorboard_interval: int = 1
    """--tensorboard-log-interval: the training scalars go to TensorBoard every this many iterations."""
    log_timers: bool = False
    """--log-timers-to-tensorboard: train/iteration_time_s too (Megatron-LM's iteration-time, the one
    timer of --timing-log-level 0)."""
    log_memory: bool = False
    """--log-memory-to-tensorboard: the activation memory figures too (memory/<kind>_max_rank)."""
    _json: object = field(default=None, init=False)
    _tb: object = field(default=None, init=False)
    _start: float = field(default_factory=time.time, init=False)
    _marks: deque = field(default_factory=lambda: deque(maxlen=ETA_WINDOW + 1), init=False)
    """(iteration, time) of the latest progress lines, for the ETA."""

    def __post_init__(self):
        if self.json_path:
            Path(self.json_path).parent.mkdir(parents=True, exist_ok=True)
            self._json = open(self.json_path, "a", buffering=1)
        if self.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self.tensorboard_dir)

    def log(self, record: dict, placed: str, survival: float, mode_scalars: dict[str, float]) -> None:
        """One record: the progress line (its balance, the mode's `placed` text and `survival`), the
        JSON line, TensorBoard (common scalars and the mode's `mode_scalars`)."""
        iteration = record["iteration"]
        elapsed = time.time() - self._start
        record["elapsed_s"] = round(elapsed, 3)
        eta = self._eta(iteration, record["iteration_time_s"])
        layers = record["moe_layers"]
        worst = max((layer["imbalance"] for layer in layers), default=1.0)
        print(
            f"iter {iteration:6d}/{self.train_iters} | loss {record['loss']:.4f} | "
            + ("".join(f"mtp_{k + 1} loss {value:.4f} | " for k, value in enumerate(record.get("mtp_loss", [])))) +
            f"lr {record['lr']:.3e} | "
            f"{record['tokens_per_s']:9.0f} tok/s | {record['iteration_time_s'] * 1e3:7.1f} ms/it | "
            + (f"{record['tflops_per_gpu']:.3g} TFLOP/s/GPU | " if "tflops_per_gpu" in record else "")
            + (f"params norm {record['params_norm']:.3f} | " if "params_norm" in record else "")
            + (f"zeros in grad {record['num_zeros_in_grad']} | " if "num_zeros_in_grad" in record else "") +
            f"{balance_text(record['balance'])}{placed} | survival(min layer) {survival:.3f} | "
            f"{_scaling_text(record)}elapsed {elapsed:6.1f}s eta {eta:6.1f}s",
            flush=True,
        )
        if self._json is not None:
            self._json.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
        if self._tb is not None and iteration % self.tensorboard_interval == 0:
            for key in ("loss", "lr", "tokens_per_s", "loss_scale", "skipped_iterations", "tflops_per_gpu",
                        "params_norm", "num_zeros_in_grad") + (("iteration_time_s",) if self.log_timers else ()):
                if key in record:
                    self._tb.add_scalar(f"train/{key}", record[key], iteration)
            for k, value in enumerate(record.get("mtp_loss", [])):
                self._tb.add_scalar(f"train/mtp_{k + 1}_loss", value, iteration)
            self._tb.add_scalar("moe/imbalance_max_layer", worst, iteration)
            if "placed" in record["balance"]:
                self._tb.add_scalar("moe/placed_imbalance_max_layer", record["balance"]["placed"]["imbalance"], iteration)
            self._tb.add_scalar("moe/survival_min_layer", survival, iteration)
            for layer in layers:
                self._tb.add_scalar(f"moe/imbalance_layer{layer['layer']}", layer["imbalance"], iteration)
            for kind, value in record["bytes"].items():
                self._tb.add_scalar(f"bytes/{kind}", value, iteration)
            for kind, per_rank in (record.get("memory", {}) if self.log_memory else {}).items():
                self._tb.add_scalar(f"memory/{kind}_max_rank", max(per_rank), iteration)
            for tag, value in mode_scalars.items():
                self._tb.add_scalar(tag, value, iteration)

    def _eta(self, iteration: int, last_iteration_s: float) -> float:
        """Seconds left at the pace of the iterations between the last ETA_WINDOW progress lines;
        at the first line, the pace of its own iteration. The run's start (model build, the first
        iteration's warm-up and calibration) would otherwise inflate it: at iteration 10 of the
        main job it predicted about twice the real remaining time."""
        now = time.time()
        self._marks.append((iteration, now))
        first_iteration, first_time = self._marks[0]
        pace = (now - first_time) / (iteration - first_iteration) if iteration > first_iteration else last_iteration_s
        return pace * (self.train_iters - iteration)

    def log_text(self, tag: str, text: str) -> None:
        """A run-level fact (the precision line) as TensorBoard text at step 0."""
        if self._tb is not None:
            self._tb.add_text(tag, text, 0)

    def log_eval(self, iteration: int, loss: float) -> None:
        ppl = float(np.exp(min(loss, 20.0)))  # Megatron-LM's cap: exp(20) where the loss is larger
        print(f"eval at iter {iteration}: loss {loss:.4f} | ppl {ppl:.2f}", flush=True)
        if self._json is not None:
            self._json.write(json.dumps(strict_json({"iteration": iteration, "eval_loss": loss}), allow_nan=False) + "\n")
        if self._tb is not None:
            self._tb.add_scalar("eval/loss", loss, iteration)
            if self.validation_ppl:
                self._tb.add_scalar("eval/ppl", ppl, iteration)

    def close(self) -> None:
        if self._json is not None:
            self._json.close()
        if self._tb is not None:
            self._tb.close()
