"""Megatron-LM's flag table against our parser (issue 41, item 1).

megatron_patches/training/megatron_lm_arguments.json is Megatron-LM's own parser at core_v0.16.1
(tools/megatron_lm_flags.py). Every flag in it is honoured (our parser defines every one of its
option strings, with Megatron-LM's dest, type and default unless training/megatron_lm.DIFFERS
says why not) or refused (on the command line and in a --config file, with the reason and what
to do instead). Nothing in it is unknown.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import yaml

from megatron_patches.training import megatron_lm
from megatron_patches.training.arguments import ArgumentError, build_parser, parse_args

SOURCE, TABLE = megatron_lm.table()
OURS = {option: action for action in build_parser()._actions for option in action.option_strings}
HONOURED, REFUSED = megatron_lm.kinds(OURS)


def _json(value):
    return value if value is None or isinstance(value, (bool, int, float, str, list)) else repr(value)


def test_the_table_is_megatron_lm_s_at_the_pinned_release():
    assert SOURCE["repository"] == "NVIDIA/Megatron-LM" and SOURCE["path"] == "megatron/training/arguments.py"
    assert SOURCE["tag"] == f"core_v{importlib.metadata.version('megatron-core')}" == "core_v0.16.1"
    assert len(SOURCE["commit"]) == 40
    assert len(TABLE) == 651
    # two dests are shared by two flags each, both pairs inference serving's (refused as a group)
    shared = [flag for flag in TABLE if sum(other.dest == flag.dest for other in TABLE) > 1]
    assert len(shared) == 4 and {flag.group for flag in shared} == {"inference"}
    # the MoE flags Megatron-LM generates from TransformerConfig are in it, not only the hand-written ones
    assert {"--moe-router-topk", "--moe-shared-expert-intermediate-size", "--num-experts"} <= set(megatron_lm.by_option())


def test_every_flag_is_honoured_whole_or_refused():
    partly = [flag.flags for flag in HONOURED if not all(option in OURS for option in flag.flags)]
    assert not partly, f"aliases missing from our parser: {partly}"
    assert len(HONOURED) + len(REFUSED) == len(TABLE)
    assert len(HONOURED) >= 95, len(HONOURED)


def test_honoured_flags_have_megatron_lm_s_dest_type_and_default_or_a_reason():
    differences = {}
    for flag in HONOURED:
        action = OURS[flag.flags[0]]
        assert action.dest == flag.dest, (flag.flags, action.dest)
        ours = (getattr(action.type, "__name__", repr(action.type)) if action.type else None, _json(action.default),
                action.nargs, type(action).__name__)
        theirs = (flag.type, flag.default, flag.nargs, flag.action)
        if ours != theirs:
            differences[flag.dest] = (ours, theirs)
    unexplained = {dest: pair for dest, pair in differences.items() if dest not in megatron_lm.DIFFERS}
    assert not unexplained, f"(ours, Megatron-LM's) type, default, nargs, action without a reason in DIFFERS: {unexplained}"
    stale = set(megatron_lm.DIFFERS) - set(differences)
    assert not stale, f"DIFFERS explains flags that no longer differ: {stale}"


def _argv(flag: megatron_lm.MegatronFlag, option: str) -> list[str]:
    takes_value = flag.action not in ("_StoreTrueAction", "_StoreFalseAction", "_StoreConstAction", "_CountAction")
    return [option, str(flag.choices[0]) if flag.choices else "1"] if takes_value else [option]


@pytest.mark.parametrize("flag", REFUSED, ids=[flag.flags[0] for flag in REFUSED])
def test_a_refused_flag_stops_with_its_reason_and_what_to_do(flag):
    for option in flag.flags:
        with pytest.raises(ArgumentError) as caught:
            parse_args(_argv(flag, option))
        message = str(caught.value)
        refusal = megatron_lm.refusal(option)
        assert message == refusal.message(option), message
        assert f"{option} (Megatron-LM's flag, group {flag.group!r}) is refused: " in message
        assert "Instead: " in message and "did you mean" not in message


def test_refusal_reasons_by_kind():
    def reason(option):
        return megatron_lm.refusal(option).reason

    assert "fp8" in reason("--fp8-format")
    assert reason("--attention-backend").startswith("a GPU kernel")
    assert reason("--mamba-state-dim").startswith("a model kind")
    assert reason("--grpo-group-size").startswith("reinforcement-learning")
    assert reason("--moe-latent-size") == megatron_lm.NOT_BUILT
    # not built yet: leaving the flag out keeps Megatron-LM's default, which the message names
    assert megatron_lm.refusal("--moe-latent-size").instead == "leave it out (Megatron-LM's default: None)"
    # a flag with its own reason
    assert "not taken over" in reason("--use-checkpoint-args")
    assert reason("--wandb-project").startswith("Weights & Biases") and "strategies" in reason("--ckpt-fully-parallel-load")
    assert "--max-nonfinite-steps" in megatron_lm.refusal("--no-check-for-nan-in-loss-and-grad").instead
    assert megatron_lm.refusal("--use-flash-attn").instead == "leave it out (Megatron-LM's default: False)"
    assert megatron_lm.refusal("--num-layers") is not None  # a table flag; only asked for unknown options
    assert megatron_lm.refusal("--no-such-flag") is None


def test_every_refusal_category_names_real_flags():
    groups = {flag.group for flag in TABLE}
    assert set(megatron_lm.WORKLOAD_GROUPS) <= groups
    options = set(megatron_lm.by_option())
    for prefixes, _ in megatron_lm.CATEGORIES:
        for prefix in prefixes:
            assert any(o == prefix or (prefix.endswith("-") and o.startswith(prefix)) for o in options), prefix
    # GPT/BERT pre-training groups are never refused a group at a time
    assert not {"training", "transformer configuration", "distributed", "checkpointing", "data and dataloader",
                "learning rate and weight decay", "logging", "network size", "moe", "mla"} & set(megatron_lm.WORKLOAD_GROUPS)


def test_several_refused_flags_are_named_together_and_before_typos():
    with pytest.raises(ArgumentError) as caught:
        parse_args(["--moe-latent-size", "2", "--cache-mla-latents", "--num-layer", "2"])
    message = str(caught.value)
    assert message.count("is refused") == 2 and "--moe-latent-size" in message and "--cache-mla-latents" in message


def test_did_you_mean_offers_only_close_names():
    with pytest.raises(ArgumentError) as caught:
        parse_args(["--hiden-size", "64"])
    assert "--hiden-size: did you mean --hidden-size?" in str(caught.value)
    with pytest.raises(ArgumentError) as caught:
        parse_args(["--expert-tensor-parallel", "2"])  # not Megatron-LM's; close to --expert-tensor-parallel-size
    assert "did you mean --expert-tensor-parallel-size" in str(caught.value)
    with pytest.raises(ArgumentError) as caught:
        parse_args(["--sequence-sharding", "2"])  # far from every flag
    assert "did you mean" not in str(caught.value)


def test_a_refused_flag_s_dest_in_a_config_file_is_refused(tmp_path):
    config = tmp_path / "latent.yaml"
    config.write_text(yaml.safe_dump({"moe_latent_size": 2}))
    with pytest.raises(ArgumentError) as caught:
        parse_args(["--config", str(config)])
    message = str(caught.value)
    assert message.startswith(f"--config {config}: key 'moe_latent_size': --moe-latent-size "
                              "(Megatron-LM's flag, group 'transformer configuration') is refused: ")


def test_the_extraction_tool_refuses_a_folder_that_is_not_a_megatron_lm_checkout(tmp_path, capsys):
    import importlib.util

    path = megatron_lm.TABLE_PATH.parents[2] / "tools" / "megatron_lm_flags.py"
    spec = importlib.util.spec_from_file_location("megatron_lm_flags", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--megatron-lm", str(tmp_path)]) == 2
    assert f"--megatron-lm {tmp_path}: no megatron/training/arguments.py there" in capsys.readouterr().err


def test_num_workers_above_0_is_refused_until_workers_are_built():
    from megatron_patches.training.validation import validate_args

    assert validate_args(parse_args(["--num-workers", "0"]), 1).num_workers == 0
    with pytest.raises(ArgumentError, match=r"--num-workers=2: the micro-batches are read in the training process"):
        validate_args(parse_args(["--num-workers", "2"]), 1)
