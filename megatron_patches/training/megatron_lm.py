"""Megatron-LM's flag table and what this entry point does with each of its flags.

`megatron_lm_arguments.json` beside this file is Megatron-LM's own parser at tag core_v0.16.1
(the release of the pinned megatron-core), extracted mechanically by `tools/megatron_lm_flags.py`:
every flag's option strings, dest, action, type, default, nargs, choices, group and help, with
the source commit. Each of its flags is, for `pretrain_gpt_moe.py`, one of:

- honoured: our parser defines it (training/arguments.py and the modes' groups), under
  Megatron-LM's name and dest; where its type or default differs, `DIFFERS` below says why;
- refused: given on the command line or in a --config file, the run stops before any work with
  the flag, the reason and what to do instead (`refusal`). Flags of other workloads (RL,
  inference serving, vision, retrieval, NVIDIA-internal services) are refused a group at a time;
  GPT/BERT pre-training flags one category at a time (GPU kernel choices not passed to
  Megatron-Core yet, other model kinds, features not built yet), each naming Megatron-LM's
  default, which leaving the flag out keeps.

tests/training/test_megatron_lm_flags.py fails when a flag of the table is neither, or both, or an
honoured flag's dest, type or default differs from the table without an entry in `DIFFERS`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("megatron_lm_arguments.json")


@dataclass(frozen=True)
class MegatronFlag:
    """One flag of Megatron-LM's parser, as `tools/megatron_lm_flags.py` extracted it."""

    flags: tuple[str, ...]
    """Option strings (the first is the one shown; the others are aliases)."""
    dest: str
    """The namespace attribute (and --config YAML key)."""
    action: str
    """argparse's action class name (_StoreAction, _StoreTrueAction, ...)."""
    type: str | None
    """The type converter's name, or None."""
    default: object
    """Megatron-LM's default (JSON value; a non-JSON default as its repr)."""
    nargs: object
    """argparse's nargs (None: one value)."""
    choices: tuple | None
    """Allowed values, or None."""
    group: str
    """Megatron-LM's argument group title."""
    help: str | None
    """Megatron-LM's help text."""


@functools.cache
def table() -> tuple[dict, tuple[MegatronFlag, ...]]:
    """(source: repository, path, tag, commit; the flags in Megatron-LM's parser order)."""
    data = json.loads(TABLE_PATH.read_text())
    flags = tuple(
        MegatronFlag(tuple(row["flags"]), row["dest"], row["action"], row["type"], row["default"], row["nargs"],
                     tuple(row["choices"]) if row["choices"] else None, row["group"], row["help"])
        for row in data["flags"])
    return data["source"], flags


@functools.cache
def by_option() -> dict[str, MegatronFlag]:
    return {option: flag for flag in table()[1] for option in flag.flags}


@functools.cache
def by_dest() -> dict[str, MegatronFlag]:
    return {flag.dest: flag for flag in table()[1]}


# ----------------------------------------------------------------------------------------------
# Honoured flags whose type or default differs from Megatron-LM's, and why
# ----------------------------------------------------------------------------------------------

DIFFERS = {
    "expert_model_parallel_size": "default None: derived per mode (ep and fssdp: the world over TP x PP; "
                                  "zebra: 1), where Megatron-LM's 1 would give a mode no expert group",
    "recompute_modules": "nargs *: an empty list is Megatron-Core's 'core_attn' default spelled out "
                         "(Megatron-LM's + needs one value)",
    "moe_token_dispatcher_type": "default alltoall: fssdp, replicate and zebra build on the all-to-all "
                                 "dispatcher's token exchange; ep takes allgather with the flag",
    "transformer_impl": "default None: local on CPU, transformer_engine on a GPU when it imports (Megatron-LM "
                        "assumes Transformer Engine is installed)",
    "no_load_optim": "default False: a store_true flag's plain default (Megatron-LM's None reads as False)",
    "no_load_rng": "default False: a store_true flag's plain default (Megatron-LM's None reads as False)",
    "distributed_backend": "type str, default None: nccl on GPUs, gloo on CPU ranks (Megatron-LM: nccl)",
    "num_workers": "default 0, and only 0: the micro-batches are read in the training process, worker "
                   "processes are not built (Megatron-LM: 2)",
    "moe_layer_freq": "type moe_layer_freq: the same values as Megatron-LM's moe_freq_type, checked here",
    "moe_router_load_balancing_type": "nargs None: one type for every layer (Megatron-LM's + also takes a list "
                                      "per layer group)",
    "moe_aux_loss_coeff": "nargs None: one coefficient (Megatron-LM's + also takes one per load-balancing type)",
    "attention_backend": "type str: the AttnBackend names (flash, fused, unfused, local, auto), checked here",
    "exit_signal": "type signal_name: the same signal names (SIGTERM, SIGUSR1, ...) as Megatron-LM's enum handler",
}


# ----------------------------------------------------------------------------------------------
# Refused flags: the reason and what to do instead
# ----------------------------------------------------------------------------------------------

# Groups of Megatron-LM flags for other workloads: refused a group at a time.
WORKLOAD_GROUPS = {
    "rl": ("reinforcement-learning post-training (GRPO)", "Megatron-LM's RL entry point"),
    "inference": ("inference serving and text generation", "Megatron-LM's inference tools"),
    "vision": ("vision models (ViT, Swin, DINO)", "Megatron-LM's pretrain_vision_*.py"),
    "biencoder": ("retriever (ICT / biencoder) training", "Megatron-LM's pretrain_ict.py"),
    "sft": ("supervised fine-tuning data", "Megatron-LM's SFT path"),
    "one logger": ("NVIDIA's internal one-logger telemetry", "--log-json, --tensorboard-dir, --run-dir"),
    "ft_package": ("the NVIDIA Resiliency Extension's fault-tolerance package",
                   "--stall-timeout and checkpoint fallback (README, Failure behaviour)"),
    "In-process restart": ("the NVIDIA Resiliency Extension's in-process restart",
                           "--save/--load: a restarted job resumes from the newest verified checkpoint"),
    "straggler": ("the NVIDIA Resiliency Extension's straggler detector", "the per-rank timings in --log-json"),
    "workload inspector": ("NVIDIA's workload inspector server", "--log-json"),
    "msc": ("the Multi-Storage Client", "local or mounted paths"),
    "autoresume": ("ADLR autoresume (an NVIDIA-internal cluster service)", "--save/--load with Slurm requeue"),
    "heterogeneous architecture": ("per-layer heterogeneous (NAS) architectures", "uniform layers"),
    "experimental_attention_variant": ("linear-attention layer variants", "standard attention"),
    "rerun engine": ("Megatron-LM's rerun state machine (error injection, spiky-loss reruns)",
                     "--max-nonfinite-steps"),
}

# GPT/BERT pre-training flags by category: (flags or option prefixes, reason). Checked in order.
_GPU_CHOICE = ("a GPU kernel, communication or memory choice with no CPU meaning, which this entry point does "
               "not pass to Megatron-Core yet")
_OTHER_MODEL = "a model kind this entry point does not build (it trains GPT and BERT MoE models)"
_LOW_PRECISION = "fp8 / fp4 training needs Transformer Engine on GPUs of Hopper or later; not built here yet"
_CKPT_IO = ("checkpoint I/O strategies are not built: every rank writes and reads its own shards with "
            "dist_checkpointing's default torch_dist strategy")
_UNREAD = ("Megatron-Core 0.16.1's models never read it (only Megatron-LM's legacy models did), so Megatron-LM's "
           "pretrain_gpt.py ignores it too")
CATEGORIES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("--apply-residual-connection-post-layernorm",), _UNREAD),
    (("--fp8-", "--no-fp8-", "--fp4-", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
      "--num-layers-at-end-in-bf16", "--te-precision-config-file", "--keep-fp8-transpose-cache",
      "--reuse-grad-buf-for-mxfp8-param-ag", "--moe-router-padding-for-fp8", "--moe-router-padding-for-quantization",
      "--use-kitchen-attention", "--kitchen-attention-backend"), _LOW_PRECISION),
    (("--is-hybrid-model", "--mamba-", "--disable-mamba-mem-eff-path", "--hybrid-attention-ratio",
      "--hybrid-mlp-ratio", "--hybrid-override-pattern", "--spec", "--mlp-chunks-for-prefill",
      "--encoder-num-layers", "--decoder-num-layers", "--encoder-seq-length", "--decoder-seq-length",
      "--relative-attention-", "--mrope-section", "--dsa-indexer-", "--experimental-attention-variant", "--linear-",
      "--fim-", "--vocab-extra-ids", "--use-legacy-models", "--onnx-safe"), _OTHER_MODEL),
    (("--tp-comm-", "--no-tp-comm-", "--cuda-graph-", "--enable-cuda-graph", "--external-cuda-graph",
      "--moe-enable-deepep", "--moe-flex-dispatcher-backend", "--moe-deepep-num-sms", "--moe-hybridep-num-sms",
      "--attention-backend", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
      "--no-bias-dropout-fusion", "--no-rope-fusion", "--use-flash-attn", "--no-persist-layer-norm",
      "--no-gradient-accumulation-fusion", "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl",
      "--moe-permute-fusion", "--moe-router-fusion", "--use-te-activation-func", "--use-fused-weighted-squared-relu",
      "--disable-jit-fuser", "--use-nccl-ub", "--disable-symmetric-registration", "--fsdp-manual-registration",
      "--use-sharp", "--sharp-enabled-group", "--symmetric-ar-type", "--high-priority-stream-groups",
      "--nccl-communicator-config-path", "--te-rng-tracker", "--disable-bf16-reduced-precision-matmul",
      "--batch-invariant-mode", "--moe-use-legacy-grouped-gemm", "--no-async-tensor-model-parallel-allreduce",
      "--ddp-pad-buckets-for-high-nccl-busbw", "--delay-wgrad-compute", "--overlap-moe-expert-parallel-comm",
      "--ep-overlap-early-attn-memory-release", "--fine-grained-activation-offloading", "--offload-modules",
      "--min-offloaded-tensor-size", "--cpu-offloading-num-layers", "--optimizer-cpu-offload",
      "--optimizer-offload-fraction", "--use-torch-optimizer-for-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
      "--no-pin-cpu-grads", "--no-pin-cpu-params", "--use-ring-exchange-p2p", "--flash-decode",
      "--inference-fuse-tp-communication", "--empty-unused-memory-level", "--record-memory-history",
      "--memory-snapshot-path", "--moe-pad-experts-for-cuda-graph-inference", "--tp-comm-overlap"), _GPU_CHOICE),
    (("--ckpt-fully-parallel-save", "--no-ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
      "--ckpt-assume-constant-structure"), _CKPT_IO),
    (("--wandb-",), "Weights & Biases logging is not built (wandb is not a dependency); the same scalars go to "
                    "TensorBoard and the JSON records"),
)
NOT_BUILT = "not built in this entry point yet"

# Single flags with their own reason and alternative: option -> (reason, instead).
SPECIFIC = {
    "--rampup-batch-size": ("a global batch that grows during training is not built: the placement modes plan "
                            "each iteration's expert loads for one fixed global batch", "a fixed --global-batch-size"),
    "--no-check-for-nan-in-loss-and-grad": ("the world-wide non-finite check is how a NaN loss or gradient stops a run "
                                            "cleanly here (the step skipped, no checkpoint of it written); it is not "
                                            "switched off", "--max-nonfinite-steps N: skip up to N such steps, then stop"),
    "--use-checkpoint-args": ("a checkpoint's flags are not taken over: --load compares them with the command line's "
                              "(another model shape is refused, every other change listed)",
                              "give the run's flags; the resume names what differs"),
    "--no-use-tokenizer-model-from-checkpoint-args": ("it qualifies --use-checkpoint-args, which is not built (a "
                                                      "checkpoint's flags are compared, not taken over)",
                                                      "give the tokenizer flags"),
    "--async-save": ("not built yet: a checkpoint here is published (manifest, then tracker) only once every rank's "
                     "files are complete, which the asynchronous writer would finish after the call returns",
                     "leave it out (saves are synchronous)"),
}


@dataclass(frozen=True)
class Refusal:
    flag: MegatronFlag
    reason: str
    instead: str

    def message(self, option: str) -> str:
        return (f"{option} (Megatron-LM's flag, group {self.flag.group!r}) is refused: {self.reason}. "
                f"Instead: {self.instead}")


def refusal(option: str) -> Refusal | None:
    """Why Megatron-LM's `option` is refused here, or None when it is not one of Megatron-LM's flags.
    Only meaningful for options our parser does not define (an honoured flag is never refused)."""
    flag = by_option().get(option)
    if flag is None:
        return None
    if flag.group in WORKLOAD_GROUPS:
        workload, alternative = WORKLOAD_GROUPS[flag.group]
        return Refusal(flag, f"{workload} is not this entry point's work (GPT/BERT MoE pre-training)", alternative)
    if option in SPECIFIC:
        return Refusal(flag, *SPECIFIC[option])
    leave_out = f"leave it out (Megatron-LM's default: {flag.default!r})"
    for prefixes, reason in CATEGORIES:
        if any(alias == p or (p.endswith("-") and alias.startswith(p)) for p in prefixes for alias in flag.flags):
            return Refusal(flag, reason, leave_out)
    return Refusal(flag, NOT_BUILT, leave_out)


def kinds(options) -> tuple[list[MegatronFlag], list[MegatronFlag]]:
    """(honoured, refused): the table's flags any of whose option strings is in `options` (our
    parser's), and the others."""
    options = set(options)
    honoured = [flag for flag in table()[1] if options.intersection(flag.flags)]
    return honoured, [flag for flag in table()[1] if not options.intersection(flag.flags)]
