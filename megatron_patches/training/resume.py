"""What a resumed run changes against its checkpoint's flags.

Every checkpoint holds the flag values it was saved with (`iter_N/flags.json`, written by rank
0). A resume compares them with its own before any process group starts (flag validation):

- the model's shape cannot change (the weights would not fit): refused, naming both values;
  except the vocabulary's padding (to a multiple of --make-vocab-size-divisible-by x TP, so a
  new TP changes it): Megatron-Core loads the rows both paddings have, and the change is
  reported with the flag value that would keep the saved padding;
- nor can the optimizer's form (distributed or not; the experts' state apart from the dense
  parameters' or not, `experts_apart`) while its state is loaded: refused, naming --no-load-optim;
- the learning-rate schedule is the checkpoint's (Megatron-Core's OptimizerParamScheduler keeps
  its saved lr, decay and warm-up, as Megatron-LM does by default): a changed value is reported
  as not applied, unless --override-opt_param-scheduler applies it;
- everything else (iterations, intervals, parallel layout, mode, precision, ...) applies, and
  is reported.
Where the run's outputs go (--save, --load, --run-dir, ...) and how it loads are not compared.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_patches.config.models import ModelConfig, vocab_padding_multiple

FLAGS_FILE = "flags.json"

MODEL_SHAPE = (
    "model_family", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
    "num_query_groups", "kv_channels", "num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "swiglu",
    "normalization", "position_embedding_type", "max_position_embeddings", "add_bias_linear",
    "untie_embeddings_and_output_weights", "tokenizer_type", "vocab_size", "qk_layernorm", "add_qkv_bias",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "multi_latent_attention", "q_lora_rank",
    "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers",
)
OPTIMIZER_FORM = ("use_distributed_optimizer",)
"""The optimizer state's form: the distributed optimizer's and the plain one's do not load into
each other (measured: a KeyError inside Megatron-Core either way)."""


def experts_apart(flags: dict) -> bool:
    """Whether a run's optimizer state keeps the experts' Adam state apart from the dense
    parameters' (keys `chained_1.`): Megatron-Core does with expert parallelism > 1 (with EP = 1
    its expert layers look like dense ones to the optimizer), zebra always (it writes ep's EP > 1
    form). The two forms do not load into each other (measured: a KeyError inside Megatron-Core)."""
    mode, ep = flags.get("moe_parallel_mode", "ep"), flags.get("expert_model_parallel_size") or 1
    return bool(flags.get("num_experts")) and (mode == "zebra" or ep > 1)
SCHEDULE = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "weight_decay", "lr_warmup_samples",
            "lr_decay_samples", "lr_warmup_fraction", "lr_warmup_init", "lr_warmup_steps", "lr_decay_steps")
NOT_COMPARED = ("save", "load", "config", "run_dir", "log_json", "tensorboard_dir", "moe_log_loads", "no_load_optim",
                "no_load_rng", "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler", "model_source",
                "finetune")
# unset at validation when the embedded corpus is used: the loop fills them at start-up
# (training/loop.py resolve_default_corpus), so the checkpoint holds the corpus's values
FILLED_AT_START = ("data_path", "tokenizer_type", "vocab_file", "merge_file")


def vocab_padding_note(saved: dict, now: dict) -> str | None:
    """A line when the vocabulary pads to another multiple than the checkpoint's (Megatron pads it
    to --make-vocab-size-divisible-by x TP): the embedding and output layer then have other
    padding rows. Megatron-Core loads the rows both have (its vocabulary tensors allow the shape
    mismatch), but the output softmax also spans the padding rows, so the losses move a little
    (measured: 2.4e-4 relative on the first resumed loss, TP 2 -> 1 at the default 128)."""
    def multiple(flags: dict) -> int:
        return vocab_padding_multiple(flags.get("make_vocab_size_divisible_by") or ModelConfig.make_vocab_size_divisible_by,
                                      flags.get("tensor_model_parallel_size") or 1)

    before, after = multiple(saved), multiple(now)
    if before == after:
        return None
    tp = now.get("tensor_model_parallel_size") or 1
    keep = (f"--make-vocab-size-divisible-by {before // tp} keeps the checkpoint's padding" if before % tp == 0
            else f"no --make-vocab-size-divisible-by keeps it at TP {tp}")
    return (f"vocabulary padding: to a multiple of {after} (was {before}; --make-vocab-size-divisible-by x TP): the rows "
            f"both have are loaded, the padding rows differ and move the losses slightly; {keep}")


def saved_flags(args) -> dict:
    """The flag values worth keeping with a checkpoint (JSON-representable ones)."""
    return {dest: list(value) if isinstance(value, tuple) else value for dest, value in sorted(vars(args).items())
            if isinstance(value, (bool, int, float, str, list, tuple, type(None)))}


def write_flags(directory: Path, args) -> None:
    (directory / FLAGS_FILE).write_text(json.dumps(saved_flags(args), indent=1) + "\n")


def read_flags(directory: Path) -> dict | None:
    """The flags a checkpoint was saved with; None for a checkpoint written before they were kept."""
    path = directory / FLAGS_FILE
    return json.loads(path.read_text()) if path.exists() else None


def compare(args, saved: dict, compared: list[str]) -> tuple[list[tuple[str, object, object, str]], list[str]]:
    """(refused changes as (dest, saved, now, what would be valid), a line per other change)
    over `compared` dests."""
    now = saved_flags(args)
    refused, notes = [], []
    for dest in compared:
        if dest in NOT_COMPARED or dest not in saved or saved[dest] == now.get(dest):
            continue
        if dest in FILLED_AT_START and now.get(dest) is None:
            continue
        before, after = saved[dest], now.get(dest)
        flag = f"--{dest.replace('_', '-')}"
        if dest in MODEL_SHAPE:
            refused.append((dest, before, after, f"a model's shape cannot change on resume; valid: {before}, or no "
                                                 "--load (a new model)"))
        elif dest in OPTIMIZER_FORM and not args.no_load_optim:
            refused.append((dest, before, after, "Megatron-Core cannot load the other optimizer's state (its sharded "
                                                 f"state has other keys); valid: {before}, or --no-load-optim (fresh "
                                                 "Adam moments, the model's weights loaded)"))
        elif dest in SCHEDULE and args.override_opt_param_scheduler:
            notes.append(f"{flag} {before} -> {after}: applied (--override-opt_param-scheduler)")
        elif dest in SCHEDULE and args.no_load_optim:
            # Megatron-LM loads the scheduler with the optimizer state: without it, a fresh schedule
            notes.append(f"{flag} {before} -> {after}: applied (--no-load-optim: the LR schedule starts afresh)")
        elif dest in SCHEDULE:
            notes.append(f"{flag} {before} -> {after}: not applied, the LR schedule continues from the checkpoint's "
                         "(--override-opt_param-scheduler applies it)")
        else:
            notes.append(f"{flag} {before} -> {after}: applied")
    padding = vocab_padding_note(saved, now)
    if padding:
        notes.append(padding)
    if not args.no_load_optim and experts_apart(saved) != experts_apart(now):
        apart = experts_apart(saved)
        refused.append(("expert_model_parallel_size", saved.get("expert_model_parallel_size"), now.get("expert_model_parallel_size"),
                        f"its optimizer state keeps the experts' Adam state {'apart from' if apart else 'with'} the dense "
                        f"parameters' (mode {saved.get('moe_parallel_mode', 'ep')}), this run's would keep it "
                        f"{'with' if apart else 'apart from'} them (Megatron-Core keeps it apart with "
                        "--expert-model-parallel-size > 1, zebra always); valid: "
                        f"{'> 1 (or zebra)' if apart else '1 (not zebra)'}, or --no-load-optim (fresh Adam moments, the "
                        "model's weights loaded)"))
    return refused, notes
