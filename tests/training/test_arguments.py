"""Tests of the training script's arguments (megatron_patches/training/: arguments.py, yaml_config.py,
validation.py, flag_docs.py; each mode's flags in its config.py).

One test per validation rule (each asserts that the message names the flag and the offending
value), YAML layering (defaults < config < later config < CLI), YAML key and type errors, the
expert-parallel default against a brute-force search, the generated docs/flags.md, and
describe_args. No process groups; torch is imported once by validate_args (params_dtype).
"""

import ast
import copy
import signal
import importlib.metadata
from pathlib import Path

import numpy as np
import pytest
import yaml

from megatron_patches.config.flags import fail, moe_layer_freq
from megatron_patches.mode.spec import ModeSpec
from megatron_patches.training import arguments as A
from megatron_patches.training import checkpoint_dirs, flag_docs, modes
from megatron_patches.training.arguments import ArgumentError, build_parser, parse_args
from megatron_patches.training.flag_docs import describe_args, flag_reference_markdown
from megatron_patches.training.validation import validate_args

# A small MoE model given explicitly, so that the tests do not depend on tiny.yaml's values.
MODEL = {
    "model_family": "gpt",
    "num_layers": 4,
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "seq_length": 32,
    "max_position_embeddings": 64,
    "num_experts": 8,
    "moe_router_topk": 2,
    "vocab_size": 1000,
}
# The run flags: the embedded tiny job's (Megatron-LM requires micro batch, iterations and lr).
RUN = yaml.safe_load((A.REPO_ROOT / "configs" / "tiny_job.yaml").read_text())


@pytest.fixture
def write_yaml(tmp_path):
    def write(name, data):
        path = tmp_path / name
        path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
        return str(path)

    return write


@pytest.fixture
def parse(write_yaml):
    """parse_args over the MODEL config and the RUN flags plus the given flags."""
    model = write_yaml("model.yaml", {**MODEL, **RUN})
    return lambda *flags: parse_args(["--config", model, *flags])


def expect_error(args, world_size, *fragments):
    with pytest.raises(ArgumentError) as caught:
        validate_args(args, world_size)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# ---------------------------------------------------------------------------------------------
# Flag names
# ---------------------------------------------------------------------------------------------

MEGATRON_FLAGS = """
--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --seq-length
--max-position-embeddings --micro-batch-size --global-batch-size --train-iters --lr --min-lr
--lr-decay-style --lr-warmup-iters --lr-decay-iters --weight-decay --clip-grad --adam-beta1
--adam-beta2 --adam-eps --init-method-std --hidden-dropout --attention-dropout --seed
--tensor-model-parallel-size --pipeline-model-parallel-size --expert-model-parallel-size
--expert-tensor-parallel-size --sequence-parallel --use-distributed-optimizer
--overlap-grad-reduce --overlap-param-gather --num-experts --moe-router-topk --moe-ffn-hidden-size
--moe-aux-loss-coeff --moe-router-load-balancing-type --moe-token-dispatcher-type
--moe-expert-capacity-factor --moe-pad-expert-input-to-capacity --moe-grouped-gemm
--disable-bias-linear --data-path --split --tokenizer-type --vocab-file --merge-file --vocab-size
--make-vocab-size-divisible-by --save --load --save-interval --no-load-optim --no-load-rng
--eval-interval --eval-iters --log-interval --tensorboard-dir --bf16 --fp16 --num-workers
--config --model-family --moe-parallel-mode --log-json --moe-log-loads --mock-data --cpu
""".split()


def test_parser_has_every_required_flag_with_megatron_dest_names():
    dests = {option: action.dest for action in build_parser()._actions
             for option in action.option_strings}
    assert set(MEGATRON_FLAGS) <= set(dests)
    # Megatron-LM's dest names where they differ from the flag.
    assert dests["--disable-bias-linear"] == "add_bias_linear"
    assert dests["--bert-no-binary-head"] == "bert_binary_head"
    assert dests["--no-load-optim"] == "no_load_optim"


def test_cli_syntax_errors_are_one_line_refusals(parse):
    with pytest.raises(ArgumentError, match="argument --num-layers: invalid int value: 'two'; valid flags: "):
        parse("--num-layers", "two")
    # no abbreviations, as in Megatron-LM
    with pytest.raises(ArgumentError, match="unrecognized arguments: --num-layer 2; --num-layer: did you mean "
                                            "--num-layers"):
        parse("--num-layer", "2")


# ---------------------------------------------------------------------------------------------
# Layering and YAML
# ---------------------------------------------------------------------------------------------


def test_layering_default_config_later_config_cli(write_yaml):
    first = write_yaml("first.yaml", {**MODEL, "lr": 0.01, "seed": 7})
    second = write_yaml("second.yaml", {"lr": 0.02})
    assert parse_args(["--config", first]).lr == 0.01
    assert parse_args(["--config", first]).train_iters is None  # Megatron-LM's default survives
    layered = parse_args(["--config", first, "--config", second])
    assert layered.lr == 0.02 and layered.seed == 7 and layered.num_layers == MODEL["num_layers"]
    assert layered.config == [first, second]
    cli = parse_args(["--config", first, "--lr", "0.03", "--config", second])
    assert cli.lr == 0.03 and cli.seed == 7
    # A CLI flag equal to the parser default still wins over the config.
    assert parse_args(["--config", first, "--seed", "1234"]).seed == 1234


def test_without_config_and_model_size_flags_the_tiny_job_is_loaded():
    args = parse_args(["--seq-length", "64", "--moe-router-topk", "1"])
    assert args.config == [str(path) for path in A.EMBEDDED_JOB]
    job = {key: value for path in A.EMBEDDED_JOB for key, value in yaml.safe_load(path.read_text()).items()}
    assert {"num_layers", "hidden_size", "num_experts", "train_iters", "lr", "micro_batch_size"} <= set(job)
    for key, value in job.items():
        assert getattr(args, key) == (64 if key == "seq_length" else value), key
    assert args.moe_router_topk == 1 and "embedded tiny job" in args.model_source
    validated = validate_args(args, 1)
    # Megatron-LM's derivations, not values written in tiny.yaml
    assert validated.moe_ffn_hidden_size == job["ffn_hidden_size"] and validated.max_position_embeddings == 64


@pytest.mark.parametrize("flag", A.MODEL_SIZE_FLAGS)
def test_a_model_size_flag_takes_megatron_lm_s_defaults_not_the_tiny_job_s(flag):
    args = parse_args([flag, "8"])
    assert args.config == [] and flag in args.model_source
    described = {"--num-layers": "num_layers", "--hidden-size": "hidden_size",
                 "--num-attention-heads": "num_attention_heads", "--num-experts": "num_experts"}
    for option, dest in described.items():
        assert getattr(args, dest) == (8 if option == flag else None), dest
    assert (args.train_iters, args.lr, args.micro_batch_size) == (None, None, None)
    assert (args.log_interval, args.eval_interval, args.eval_iters, args.lr_decay_style) == (100, None, 100, "linear")
    expect_error(args, 1, "is not set", "Megatron-LM has no default for these flags", flag)


def test_megatron_lm_s_derivations_for_a_script_s_model():
    run = ["--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-4", "--seq-length", "256"]
    gpt = validate_args(parse_args(["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8",
                                    "--num-experts", "8", *run]), 1)
    assert gpt.ffn_hidden_size == 2048 and gpt.moe_ffn_hidden_size == 2048 and gpt.moe_router_topk == 2
    assert gpt.max_position_embeddings == 256 and gpt.kv_channels == 64
    # A Mixtral script gives --ffn-hidden-size and no --moe-ffn-hidden-size: the experts are that wide
    mixtral = validate_args(parse_args(["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8",
                                        "--ffn-hidden-size", "1792", "--num-experts", "8", "--swiglu", *run]), 1)
    assert mixtral.moe_ffn_hidden_size == 1792
    swiglu = validate_args(parse_args(["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8",
                                       "--num-experts", "8", "--swiglu", *run]), 1)
    assert swiglu.ffn_hidden_size == int(4 * 512 * 2 / 3 / 64) * 64 == 1344
    # no --num-experts: a dense model, refused (every mode places experts)
    expect_error(parse_args(["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8", *run]), 1,
                 "--num-experts=None", "dense", "pretrain_gpt.py", "the command line (--num-layers")


def test_a_given_config_replaces_the_default_model(write_yaml):
    run = write_yaml("run.yaml", {"lr": 0.005})
    args = parse_args(["--config", run])
    assert args.num_layers is None
    expect_error(args, 1, "--num-layers is not set (configs/models/*.yaml set it)", "--micro-batch-size is not set",
                 f"The model came from --config {run}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_no_flag_run_validates(world):
    args = validate_args(parse_args([]), world)
    experts = args.num_experts
    expected_ep = max(e for e in range(1, experts + 1) if experts % e == 0 and world % e == 0)
    assert args.expert_model_parallel_size == expected_ep
    assert args.data_parallel_size == world and args.global_batch_size == 4 * world
    # The embedded corpus (269 chapters) gets a split whose test share is 0 (it would be empty).
    assert args.num_micro_batches == 1 and args.split == "949,51,0"


def test_default_split_is_megatron_lm_s_when_data_is_given():
    args = validate_args(parse_args(["--mock-data", "--vocab-size", "1000"]), 1)
    assert args.split == "969,30,1"


def test_bert_needs_moe_in_every_layer(parse):
    expect_error(parse("--model-family=bert", "--moe-layer-freq=2"), 1, "--moe-layer-freq=2", "valid: 1")


def test_moe_biases_need_etp_1(parse):
    expect_error(
        parse("--tensor-model-parallel-size=2", "--sequence-parallel", "--expert-tensor-parallel-size=2"),
        2, "--expert-tensor-parallel-size=2", "--disable-bias-linear",
    )
    args = validate_args(parse("--tensor-model-parallel-size=2", "--sequence-parallel",
                               "--expert-tensor-parallel-size=2", "--disable-bias-linear"), 2)
    assert args.expert_tensor_parallel_size == 2


def test_yaml_values_are_converted_to_the_flag_types(write_yaml):
    config = write_yaml("types.yaml", "num_layers: 2\nlr: 1e-3\nadd_bias_linear: false\n"
                                      "split: 100\ndata_path: [0.3, a, 0.7, b]\n"
                                      "moe_expert_capacity_factor: 2\nsave: null\nfssdp_calibrate: false\n")
    args = parse_args(["--config", config])
    assert args.fssdp_calibrate is False  # a --x / --no-x flag takes true / false too
    assert parse_args(["--config", config, "--fssdp-calibrate"]).fssdp_calibrate is True
    assert args.lr == 0.001 and isinstance(args.lr, float)  # PyYAML reads 1e-3 as a string
    assert args.add_bias_linear is False
    assert args.split == "100"
    assert args.data_path == ["0.3", "a", "0.7", "b"]
    assert args.moe_expert_capacity_factor == 2.0


def test_unknown_yaml_key_names_key_file_and_close_names(write_yaml):
    config = write_yaml("typo.yaml", {"num_layer": 2})
    with pytest.raises(ArgumentError) as caught:
        parse_args(["--config", config])
    message = str(caught.value)
    assert "'num_layer'" in message and config in message and "num_layers" in message


def test_yaml_key_spelled_as_a_flag_with_another_dest_says_which_dest(write_yaml):
    config = write_yaml("dest.yaml", {"disable_bias_linear": True})
    with pytest.raises(ArgumentError, match="add_bias_linear: false"):
        parse_args(["--config", config])
    dashed = write_yaml("dashed.yaml", {"num-layers": 2})
    with pytest.raises(ArgumentError, match="num_layers"):
        parse_args(["--config", dashed])


@pytest.mark.parametrize("key, value, expected", [
    ("num_layers", "two", "expected int"),
    ("num_layers", 2.5, "expected int"),
    ("num_layers", True, "expected int"),
    ("lr", "fast", "expected float"),
    ("bf16", "yes", "expected bool"),
    ("fssdp_calibrate", "no", "expected bool"),
    ("seed", None, "expected int"),
    ("data_path", {"a": 1}, "expected list of str"),
    ("moe_layer_freq", "every other", "expected int or list of 0/1"),
])
def test_wrong_yaml_type_names_key_value_and_type(write_yaml, key, value, expected):
    config = write_yaml("bad.yaml", {key: value})
    with pytest.raises(ArgumentError) as caught:
        parse_args(["--config", config])
    message = str(caught.value)
    assert repr(key) in message and repr(value) in message and expected in message
    assert config in message


def test_yaml_file_problems(write_yaml, tmp_path):
    with pytest.raises(ArgumentError, match="file not found"):
        parse_args(["--config", str(tmp_path / "absent.yaml")])
    with pytest.raises(ArgumentError, match="must be a mapping"):
        parse_args(["--config", write_yaml("list.yaml", "- 1\n- 2\n")])
    with pytest.raises(ArgumentError, match="not valid YAML"):
        parse_args(["--config", write_yaml("broken.yaml", "a: [1, 2\n")])
    with pytest.raises(ArgumentError, match="cannot include other files"):
        parse_args(["--config", write_yaml("nested.yaml", {"config": "x.yaml"})])
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("# réglages\nnum_layers: 2\n".encode("latin-1"))
    with pytest.raises(ArgumentError, match=r"latin1.yaml: not UTF-8 text \(byte 0xe9 at offset 3\); save it as UTF-8"):
        parse_args(["--config", str(latin1)])


def test_every_model_config_in_the_repository_parses_and_validates():
    configs = sorted((A.REPO_ROOT / "configs" / "models").glob("*.yaml"))
    if not configs:
        pytest.skip("no model configs yet")
    for path in configs:
        args = validate_args(parse_args(["--config", str(path), "--micro-batch-size", "1", "--train-iters", "10",
                                         "--lr", "1e-4"]), 1)
        assert args.num_layers > 0, path


# ---------------------------------------------------------------------------------------------
# Derived values
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world, flags, expected_ep", [
    (1, [], 1),
    (4, [], 4),  # torchrun --nproc-per-node 4 with 8 experts
    (6, [], 2),
    (12, [], 4),
    (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--disable-bias-linear"], 4),
    (4, ["--pipeline-model-parallel-size", "2"], 2),
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--expert-tensor-parallel-size", "1"], 4),
    (8, ["--num-experts", "6"], 2),
])
def test_expert_parallel_default(parse, world, flags, expected_ep):
    args = validate_args(parse(*flags), world)
    assert args.expert_model_parallel_size == expected_ep
    assert args.expert_data_parallel_size == (
        world // args.pipeline_model_parallel_size
        // (args.expert_tensor_parallel_size * expected_ep))


def test_expert_parallel_default_is_the_largest_valid_ep_brute_force(parse):
    """The resolved EP equals the largest explicit EP that validate_args accepts."""
    bases = {(tp, pp): parse("--tensor-model-parallel-size", str(tp),
                             "--pipeline-model-parallel-size", str(pp), "--sequence-parallel",
                             "--disable-bias-linear")
             for tp in (1, 2) for pp in (1, 2)}
    checked = 0
    for (tp, pp), base in bases.items():
        for world in range(1, 9):
            if world % (tp * pp):
                continue
            for experts in range(1, 13):
                args = copy.deepcopy(base)
                args.num_experts = experts
                args.moe_router_topk = 1
                accepted = []
                for ep in range(1, experts + 1):
                    trial = copy.deepcopy(args)
                    trial.expert_model_parallel_size = ep
                    try:
                        validate_args(trial, world)
                        accepted.append(ep)
                    except ArgumentError:
                        pass
                resolved = validate_args(copy.deepcopy(args), world).expert_model_parallel_size
                assert resolved == max(accepted), (tp, pp, world, experts)
                checked += 1
    assert checked > 100


def test_derived_values(parse):
    args = validate_args(parse("--global-batch-size", "32", "--tensor-model-parallel-size", "2",
                               "--sequence-parallel", "--disable-bias-linear", "--bf16"), 4)
    assert args.data_parallel_size == 2 and args.num_micro_batches == 4  # 32 / (4 x 2)
    assert args.expert_tensor_parallel_size == 2  # Megatron-LM: ETP defaults to TP
    assert args.moe_ffn_hidden_size == MODEL["ffn_hidden_size"]
    assert args.lr_decay_iters == args.train_iters
    assert str(args.params_dtype) == "torch.bfloat16"
    assert args.distributed_backend in ("gloo", "nccl") and args.world_size == 4


def test_swiglu_ffn_default_is_megatrons(parse):
    args = parse("--swiglu")
    args.ffn_hidden_size = None
    assert validate_args(args, 1).ffn_hidden_size == int(4 * 64 * 2 / 3 / 64) * 64  # 128


def test_sequence_parallel_is_turned_off_at_tp1(parse):
    assert validate_args(parse("--sequence-parallel"), 2).sequence_parallel is False


def test_validate_twice_gives_the_same_namespace(parse, tmp_path):
    args = validate_args(parse("--mock-data", "--save", str(tmp_path), "--save-interval", "5"), 4)
    again = validate_args(copy.deepcopy(args), 4)
    assert vars(again) == vars(args)
    # derived from other flags: iterations from samples, the warm-up's share, a kernel choice not applied
    derived = validate_args(parse("--train-samples", "400", "--lr-warmup-fraction", "0.1", "--moe-grouped-gemm",
                                  "--cpu", "--no-masked-softmax-fusion"), 1)
    assert derived.train_iters == 100 and derived.kernel_choices_not_applied[-1] == "--moe-grouped-gemm"
    assert vars(validate_args(copy.deepcopy(derived), 1)) == vars(derived)


def test_mock_data_defaults_to_the_null_tokenizer(parse):
    assert validate_args(parse("--mock-data"), 1).tokenizer_type == "NullTokenizer"


def test_moe_layer_freq_forms(parse, write_yaml):
    assert moe_layer_freq("2") == 2
    assert moe_layer_freq("([1]*3+[0]*1)*3") == [1, 1, 1, 0] * 3
    assert moe_layer_freq([1, 0]) == [1, 0]
    for bad in ("9**9", "__import__('os')", "[1]*1000000", "[1]+2"):
        with pytest.raises(ValueError):
            moe_layer_freq(bad)
    args = validate_args(parse("--num-layers", "4", "--moe-layer-freq", "([1]+[0])*2"), 1)
    assert args.moe_layer_freq == [1, 0, 1, 0]
    config = write_yaml("freq.yaml", {**MODEL, "moe_layer_freq": [0, 1, 0, 1]})
    assert parse_args(["--config", config]).moe_layer_freq == [0, 1, 0, 1]


# ---------------------------------------------------------------------------------------------
# Validation: one test per rule
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, value", [
    ("--num-layers", "0"), ("--hidden-size", "-64"), ("--num-attention-heads", "0"),
    ("--seq-length", "-1"), ("--micro-batch-size", "0"), ("--global-batch-size", "-4"),
    ("--train-iters", "0"), ("--tensor-model-parallel-size", "0"),
    ("--pipeline-model-parallel-size", "-1"), ("--expert-model-parallel-size", "0"),
    ("--expert-tensor-parallel-size", "0"), ("--ffn-hidden-size", "0"),
    ("--moe-ffn-hidden-size", "-8"), ("--moe-router-topk", "0"), ("--vocab-size", "0"),
    ("--num-experts", "-2"), ("--eval-iters", "-1"), ("--num-workers", "-1"),
    ("--lr-warmup-iters", "-5"),
])
def test_non_positive_sizes(parse, flag, value):
    expect_error(parse(flag, value), 1, f"{flag}={value}")


@pytest.mark.parametrize("flag, value", [
    ("--hidden-dropout", "1.0"), ("--attention-dropout", "-0.1"), ("--adam-beta1", "1.0"),
    ("--adam-eps", "0"), ("--init-method-std", "0"), ("--weight-decay", "-0.1"),
    ("--clip-grad", "-1"), ("--moe-aux-loss-coeff", "-0.01"),
])
def test_out_of_range_coefficients(parse, flag, value):
    expect_error(parse(flag, value), 1, f"{flag}={float(value)}")


@pytest.mark.parametrize("flags, fragment", [
    (["--lr", "inf"], "--lr=inf: must be a finite number"),
    (["--min-lr", "nan"], "--min-lr=nan: must be a finite number"),
    (["--clip-grad", "inf"], "--clip-grad=inf: must be a finite number"),
    (["--moe-parallel-mode", "fssdp", "--fssdp-memory-budget-mb", "inf"], "--fssdp-memory-budget-mb=inf: must be a finite number"),
    (["--seed", "-1"], "--seed=-1: valid: 0..2147483647"),
    (["--seed", str(2**31)], "--seed=2147483648"),
])
def test_non_finite_numbers_and_bad_seeds(parse, flags, fragment):
    expect_error(parse(*flags), 4, fragment)


def test_run_dir_names_the_outputs_and_explicit_flags_win(parse, tmp_path):
    run_dir = tmp_path / "runs" / "a"
    args = validate_args(parse("--run-dir", str(run_dir)), 4)
    assert (args.log_json, args.tensorboard_dir, args.moe_log_loads) == (
        str(run_dir / "metrics.jsonl"), str(run_dir / "tensorboard"), str(run_dir / "loads.npz"))
    args = validate_args(parse("--run-dir", str(run_dir), "--log-json", str(tmp_path / "m.jsonl")), 4)
    assert args.log_json == str(tmp_path / "m.jsonl") and args.moe_log_loads == str(run_dir / "loads.npz")
    # zebra runs the shared loop: its run folder holds the load trace too
    zebra = validate_args(parse("--run-dir", str(run_dir), *ZEBRA_2_2_4, "--micro-batch-size", "3"), 8)
    assert zebra.moe_log_loads == str(run_dir / "loads.npz") and zebra.log_json == str(run_dir / "metrics.jsonl")
    assert not run_dir.exists()  # created by rank 0 at start-up, not by validation


def test_output_paths_that_cannot_be_written_are_refused_up_front(parse, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    expect_error(parse("--run-dir", str(a_file)), 4, f"--run-dir={a_file}: exists and is not a directory")
    expect_error(parse("--moe-log-loads", str(a_file / "loads.npz")), 4,
                 f"--moe-log-loads={a_file / 'loads.npz'}: {a_file} is not a directory")
    expect_error(parse("--log-json", str(tmp_path)), 4, f"--log-json={tmp_path}: exists and is a directory")
    expect_error(parse("--tensorboard-dir", str(a_file)), 4, "--tensorboard-dir=")
    expect_error(parse("--run-dir", str(a_file / "run")), 4, f"--run-dir={a_file / 'run'}: {a_file} is not a directory")


def test_world_size_not_divisible_by_tp_times_pp(parse):
    expect_error(parse("--tensor-model-parallel-size", "3", "--sequence-parallel"), 4,
                 "--tensor-model-parallel-size=3", "world size 4", "[1, 2, 4]")


def test_experts_not_divisible_by_ep(parse):
    expect_error(parse("--expert-model-parallel-size", "3"), 6,
                 "--expert-model-parallel-size=3", "--num-experts=8", "valid EP here: [1, 2]")


def test_expert_grid_must_divide_world_over_pp(parse):
    expect_error(parse("--expert-model-parallel-size", "8"), 4,
                 "--expert-model-parallel-size=8", "ETP x EP = 1 x 8 = 8", "[1, 2, 4]")
    expect_error(parse("--tensor-model-parallel-size", "2", "--sequence-parallel",
                       "--expert-model-parallel-size", "4"), 4,
                 "--expert-model-parallel-size=4", "ETP x EP = 2 x 4 = 8", "[1, 2]")
    expect_error(parse("--expert-tensor-parallel-size", "3"), 4,
                 "--expert-tensor-parallel-size=3", "[1, 2, 4]")


def test_a_dense_model_is_refused(parse):
    expect_error(parse("--num-experts", "0", "--expert-model-parallel-size", "2"), 2,
                 "--num-experts=0", "the model is dense", "valid: 1 or more")


def test_global_batch_not_divisible_by_micro_batch_times_dp(parse):
    expect_error(parse("--global-batch-size", "20"), 4,
                 "--global-batch-size=20", "4 x 4 = 16", "multiples of 16")


def test_heads_not_divisible_by_tp(parse):
    expect_error(parse("--num-attention-heads", "2", "--tensor-model-parallel-size", "4",
                       "--sequence-parallel"), 4,
                 "--num-attention-heads=2", "--tensor-model-parallel-size=4")


def test_hidden_not_divisible_by_heads(parse):
    expect_error(parse("--num-attention-heads", "5"), 1, "--hidden-size=64",
                 "--num-attention-heads=5")
    validate_args(parse("--num-attention-heads", "5", "--kv-channels", "16"), 1)


def test_ffn_not_divisible_by_tp(parse):
    expect_error(parse("--ffn-hidden-size", "130", "--tensor-model-parallel-size", "4",
                       "--sequence-parallel"), 4, "--ffn-hidden-size=130")


def test_query_groups(parse):
    expect_error(parse("--group-query-attention", "--num-query-groups", "3"), 1,
                 "--num-query-groups=3", "[1, 2, 4]")
    expect_error(parse("--group-query-attention", "--num-query-groups", "1",
                       "--tensor-model-parallel-size", "2", "--sequence-parallel"), 2,
                 "--num-query-groups=1", "--tensor-model-parallel-size=2")


def test_layers_not_divisible_by_pp(parse):
    expect_error(parse("--num-layers", "3", "--pipeline-model-parallel-size", "2"), 2,
                 "--num-layers=3", "--pipeline-model-parallel-size=2", "[1, 3]")


VIRTUAL = ("--pipeline-model-parallel-size", "2", "--micro-batch-size", "1", "--global-batch-size", "4")


def test_virtual_pipeline_size_as_megatron_lm_derives_it(parse):
    """4 layers over PP 2: 1 layer per virtual stage gives 2 chunks per rank, as does 2 stages per
    rank; 2 layers per virtual stage is one chunk, no virtual pipeline (Megatron-LM sets None)."""
    for more, expected in ((("--num-layers-per-virtual-pipeline-stage", "1"), 2),
                           (("--num-virtual-stages-per-pipeline-rank", "2"), 2),
                           (("--num-layers-per-virtual-pipeline-stage", "2"), None), ((), None)):
        args = validate_args(parse(*VIRTUAL, *more), 2)
        assert args.virtual_pipeline_model_parallel_size == expected, more
        assert args.num_micro_batches == 4


def test_virtual_pipeline_refusals(parse):
    expect_error(parse(*VIRTUAL, "--num-layers-per-virtual-pipeline-stage", "3"), 2,
                 "--num-layers-per-virtual-pipeline-stage=3", "2 layers of a pipeline stage", "[1, 2]")
    expect_error(parse(*VIRTUAL, "--num-virtual-stages-per-pipeline-rank", "3"), 2,
                 "--num-virtual-stages-per-pipeline-rank=3", "PP x VP = 2 x 3")
    expect_error(parse(*VIRTUAL, "--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage",
                       "1"), 2, "give either it or --num-virtual-stages-per-pipeline-rank")
    expect_error(parse("--num-virtual-stages-per-pipeline-rank", "2"), 1,
                 "--pipeline-model-parallel-size=1", "valid: 2 or more")
    # the batched sends of a 2-stage interleaved pipeline pair the same ranks twice (Megatron-LM: PP > 2)
    expect_error(parse(*VIRTUAL, "--num-virtual-stages-per-pipeline-rank", "2", "--no-overlap-p2p-communication"), 2,
                 "--no-overlap-p2p-communication=True", "PP of 3 or more")
    # micro-batches in groups of PP per virtual stage: 1 micro-batch is fewer than PP 2
    expect_error(parse(*VIRTUAL[:-1], "2", "--num-virtual-stages-per-pipeline-rank", "2"), 4,
                 "--global-batch-size=2", "gives 1 micro-batches", "groups of 2")
    expect_error(parse(*VIRTUAL, "--num-virtual-stages-per-pipeline-rank", "2",
                       "--microbatch-group-size-per-virtual-pipeline-stage", "5"), 2,
                 "--microbatch-group-size-per-virtual-pipeline-stage=5", "the 4 micro-batches")
    for flag in (("--no-overlap-p2p-communication",), ("--microbatch-group-size-per-virtual-pipeline-stage", "2")):
        expect_error(parse(*VIRTUAL, *flag), 2, f"{flag[0]}=", "one model chunk per pipeline rank")
    expect_error(parse(*VIRTUAL, "--num-virtual-stages-per-pipeline-rank", "2", "--model-family", "bert",
                       "--seq-length", "64"), 2, "BertModel builds no virtual pipeline stage")
    # full recompute counts the layers of one chunk
    expect_error(parse(*VIRTUAL, "--num-virtual-stages-per-pipeline-rank", "2", "--recompute-granularity", "full",
                       "--recompute-method", "uniform", "--recompute-num-layers", "2"), 2,
                 "--recompute-num-layers=2", "between 1 and 1 (the layers of one virtual pipeline stage)")


def test_seq_length_beyond_position_embeddings(parse):
    expect_error(parse("--seq-length", "128"), 1, "--seq-length=128",
                 "--max-position-embeddings=64")


def test_sequence_parallel_needs_seq_divisible_by_tp(parse):
    expect_error(parse("--seq-length", "33", "--tensor-model-parallel-size", "2",
                       "--sequence-parallel"), 2, "--seq-length=33", "multiple of 2")


def test_topk_beyond_experts(parse):
    expect_error(parse("--moe-router-topk", "9"), 1, "--moe-router-topk=9", "1..8")


def test_moe_layer_pattern_length(parse):
    expect_error(parse("--moe-layer-freq", "[1,0]"), 1, "--moe-layer-freq=[1, 0]", "4 in all")
    expect_error(parse("--moe-layer-freq", "0"), 1, "--moe-layer-freq=0")


def test_tensor_parallel_moe_needs_sequence_parallel(parse):
    expect_error(parse("--tensor-model-parallel-size", "2"), 2,
                 "--tensor-model-parallel-size=2", "--sequence-parallel", "Megatron-Core")


def test_fp16_with_bf16(parse):
    expect_error(parse("--fp16", "--bf16"), 1, "--fp16", "--bf16")


def test_fp16_with_expert_parallelism_and_loss_scaling_flags(parse):
    # Megatron-LM refuses --fp16 with EP; here one loss scale covers the world (compat.mcore.WorldLossScaling)
    args = validate_args(parse("--fp16", "--expert-model-parallel-size", "2"), 2)
    assert str(args.params_dtype) == "torch.float16" and not args.accumulate_allreduce_grads_in_fp32
    assert validate_args(parse("--bf16"), 2).accumulate_allreduce_grads_in_fp32  # Megatron-LM's bf16 rule
    expect_error(parse("--loss-scale", "1024"), 1, "--loss-scale=1024", "--fp16")
    expect_error(parse("--fp16", "--loss-scale", "-2"), 1, "--loss-scale=-2", "positive")
    expect_error(parse("--fp16", "--loss-scale", "inf"), 1, "--loss-scale=inf", "finite")
    expect_error(parse("--fp16", "--initial-loss-scale", "nan"), 1, "--initial-loss-scale=nan")
    expect_error(parse("--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"), 1,
                 "--min-loss-scale=8", "--initial-loss-scale=4")
    expect_error(parse("--fp16", "--hysteresis", "0"), 1, "--hysteresis=0", ">= 1")
    expect_error(parse("--fp16", "--loss-scale-window", "0.5"), 1, "--loss-scale-window=0.5")
    expect_error(parse("--accumulate-allreduce-grads-in-fp32"), 1, "--accumulate-allreduce-grads-in-fp32", "--fp16")


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--recompute-method", "uniform"], ["--recompute-method=uniform", "--recompute-granularity"]),
        (["--recompute-granularity", "full"], ["--recompute-granularity=full", "--recompute-method", "--recompute-num-layers"]),
        (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "5"],
         ["--recompute-num-layers=5", "between 1 and 4"]),
        (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1",
          "--recompute-modules", "mlp"], ["--recompute-modules=mlp", "selective"]),
        (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], ["--recompute-num-layers=1", "full"]),
        (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mla_up_proj"],
         ["--recompute-modules=mla_up_proj", "needs --multi-latent-attention"]),
        (["--recompute-granularity", "selective", "--recompute-modules", "moe_act"], ["moe_act", "--moe-grouped-gemm"]),
    ],
)
def test_recompute_flags(parse, flags, fragments):
    expect_error(parse(*flags), 1, *fragments)


def test_moe_recompute_is_refused_in_instance_modes(parse):
    for mode in ("fssdp", "replicate"):
        expect_error(parse("--moe-parallel-mode", mode, "--recompute-granularity", "selective", "--recompute-modules",
                           "layernorm", "moe"), 4, "--recompute-modules=moe", "--recompute-granularity full")


def test_recompute_flags_reach_transformer_config(parse):
    from megatron_patches.training.model import transformer_config

    config = transformer_config(validate_args(parse("--recompute-granularity", "full", "--recompute-method", "block",
                                                    "--recompute-num-layers", "0"), 1), on_gpu=False)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 0)
    config = transformer_config(validate_args(parse("--recompute-granularity", "selective", "--recompute-modules",
                                                    "layernorm", "moe", "--attention-softmax-in-fp32"), 1), on_gpu=False)
    assert config.recompute_modules == ["layernorm", "moe"] and config.attention_softmax_in_fp32


def test_gpu_kernel_choices_are_listed_on_cpu_and_deprecated_flags_named(parse):
    # ep's grouped GEMM is Megatron's GroupedMLP (CUDA): on CPU the experts run one after another,
    # and the start-up line says so, as for every other kernel choice given
    args = validate_args(parse("--moe-grouped-gemm", "--cpu", "--no-masked-softmax-fusion", "--attention-backend",
                               "unfused", "--no-rope-fusion", "--use-mcore-models"), 1)
    assert args.moe_grouped_gemm is False
    assert args.kernel_choices_not_applied == ["--no-masked-softmax-fusion", "--no-rope-fusion", "--attention-backend",
                                               "--moe-grouped-gemm"]
    assert args.flags_without_effect == ["--use-mcore-models"]
    plain = validate_args(parse("--cpu"), 1)
    assert plain.kernel_choices_not_applied == [] and plain.flags_without_effect == []
    expect_error(parse("--attention-backend", "sdpa"), 1, "--attention-backend=sdpa", "flash, fused, unfused, local, auto")
    # Megatron-LM: --no-position-embedding only with rope, where it changes nothing
    expect_error(parse("--no-position-embedding"), 1, "--no-position-embedding=True", "--position-embedding-type none")
    rope = validate_args(parse("--no-position-embedding", "--position-embedding-type", "rope"), 1)
    assert rope.flags_without_effect == ["--no-position-embedding"]


@pytest.mark.parametrize("mode", ["fssdp", "replicate"])
def test_instance_modes_group_their_gemms_on_cpu_in_any_precision(parse, mode):
    grouped = ("--moe-parallel-mode", mode, "--expert-model-parallel-size", "4", "--moe-grouped-gemm", "--cpu")
    for precision in ([], ["--bf16"], ["--fp16"]):
        args = validate_args(parse(*grouped, "--disable-bias-linear", *precision), 4)
        assert args.moe_grouped_gemm
    # Megatron's GroupedMLP has no biases, nor has the grouped GEMM of the instances
    expect_error(parse(*grouped), 4, "--moe-grouped-gemm", "--disable-bias-linear")
    # torch's grouped matmul needs 16-byte strides: a width of 36 bf16 elements has 72 bytes
    expect_error(parse(*grouped, "--disable-bias-linear", "--bf16", "--moe-ffn-hidden-size", "36"), 4,
                 "--moe-grouped-gemm", "--moe-ffn-hidden-size / --expert-tensor-parallel-size=36", "multiples of 8")
    expect_error(parse(*grouped, "--disable-bias-linear", "--recompute-granularity", "selective",
                       "--recompute-modules", "moe_act"), 4, "--recompute-modules", "moe_act", mode)


def test_overlap_param_gather_needs_distributed_optimizer(parse):
    expect_error(parse("--overlap-param-gather", "--overlap-grad-reduce"), 1,
                 "--overlap-param-gather", "--use-distributed-optimizer")


def write_dataset(prefix, sequences=((1, 2, 3), (4, 5, 6, 7))) -> None:
    """A real Megatron indexed dataset (Megatron's own builder), one document per sequence."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
    for ids in sequences:
        builder.add_document(numpy.array(ids, dtype=numpy.uint16), [len(ids)])
    builder.finalize(f"{prefix}.idx")


def test_missing_data_files(parse, tmp_path):
    prefix = tmp_path / "corpus_text_document"
    write_dataset(prefix)
    Path(f"{prefix}.idx").unlink()
    message = expect_error(parse("--data-path", str(prefix), "--tokenizer-type", "NullTokenizer"),
                           1, "--data-path", str(prefix), ".idx")
    assert ".bin" not in message.split("missing")[1].split(";")[0]
    write_dataset(prefix)
    validate_args(parse("--data-path", str(prefix), "--tokenizer-type", "NullTokenizer"), 1)
    # Megatron-LM's "weight prefix weight prefix" form: the second prefix is missing.
    absent = tmp_path / "absent"
    expect_error(parse("--data-path", "0.3", str(prefix), "0.7", str(absent),
                       "--tokenizer-type", "NullTokenizer"), 1,
                 f"--data-path={absent}", f"{absent}.bin and {absent}.idx")
    # A list of prefixes.
    expect_error(parse("--data-path", str(prefix), str(absent), "--tokenizer-type",
                       "NullTokenizer"), 1, f"--data-path={absent}")


def test_damaged_data_files_are_refused_before_any_process_group(parse, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    good, other = tmp_path / "good", tmp_path / "other"
    write_dataset(good)
    write_dataset(other, [(9,) * 10])
    assert len(IndexedDataset(str(good))) == 2  # Megatron reads what the check accepts
    idx, bin_ = Path(f"{good}.idx"), Path(f"{good}.bin")
    index, tokens = idx.read_bytes(), bin_.read_bytes()
    cases = [
        (lambda: bin_.write_bytes(tokens[:-2]), f"{bin_} is 12 bytes but {idx} describes 14 bytes (2 sequences of uint16"),
        (lambda: bin_.write_bytes(Path(f"{other}.bin").read_bytes()), "truncated, or the two files do not belong together"),
        (lambda: idx.write_bytes(b""), f"{idx} is 0 bytes, shorter than an index header (34 bytes)"),
        (lambda: idx.write_bytes(b"PK\x03\x04" + index[4:]), "does not start with Megatron's index magic"),
        (lambda: idx.write_bytes(index[:40]), "but its header promises 2 sequences and 3 document indices"),
        (lambda: idx.write_bytes(index[:9] + (2).to_bytes(8, "little") + index[17:]), "is index format version 2"),
    ]
    for damage, fragment in cases:
        damage()
        expect_error(parse("--data-path", str(good), "--tokenizer-type", "NullTokenizer"), 1, f"--data-path={good}",
                     fragment, "(tools/prepare_data.py builds a valid dataset)")
        idx.write_bytes(index)
        bin_.write_bytes(tokens)


def test_bad_data_path_forms(parse, tmp_path):
    prefix = str(tmp_path / "p")
    expect_error(parse("--data-path", "0.5", prefix, prefix, prefix,
                       "--tokenizer-type", "NullTokenizer"), 1, "--data-path", "mixes")
    expect_error(parse("--data-path", "-1", prefix, "--tokenizer-type", "NullTokenizer"), 1,
                 "--data-path", "weight -1")
    expect_error(parse("--data-path", "--tokenizer-type", "NullTokenizer"), 1, "--data-path")


def test_data_path_with_mock_data(parse, tmp_path):
    expect_error(parse("--data-path", str(tmp_path / "p"), "--mock-data"), 1,
                 "--data-path", "--mock-data")


def test_unknown_tokenizer_type(parse):
    expect_error(parse("--tokenizer-type", "GPT3Tokenizer"), 1,
                 "--tokenizer-type=GPT3Tokenizer", "GPT2BPETokenizer", "NullTokenizer",
                 "SentencePieceTokenizer", "HuggingFaceTokenizer")


def test_data_path_needs_a_tokenizer_type(parse, tmp_path):
    prefix = tmp_path / "d"
    write_dataset(prefix)
    expect_error(parse("--data-path", str(prefix)), 1, "--tokenizer-type is not set",
                 "--data-path")


def test_gpt2_bpe_without_vocab_and_merges(parse, tmp_path):
    prefix = tmp_path / "d"
    write_dataset(prefix)
    flags = ("--data-path", str(prefix), "--tokenizer-type", "GPT2BPETokenizer")
    expect_error(parse(*flags), 1, "--tokenizer-type=GPT2BPETokenizer", "--vocab-file",
                 "--merge-file")
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text("{}")
    message = expect_error(parse(*flags, "--vocab-file", str(vocab)), 1, "--merge-file")
    assert "--vocab-file" not in message
    expect_error(parse(*flags, "--vocab-file", str(vocab), "--merge-file",
                       str(tmp_path / "nope.txt")), 1, "--merge-file=", "not found")
    merges.write_text("#version: 0.2\n")
    validate_args(parse(*flags, "--vocab-file", str(vocab), "--merge-file", str(merges)), 1)
    # Without a data source the default corpus supplies the files.
    validate_args(parse("--tokenizer-type", "GPT2BPETokenizer"), 1)


def test_null_tokenizer_needs_vocab_size(parse):
    args = parse("--mock-data")
    args.vocab_size = None
    expect_error(args, 1, "--tokenizer-type=NullTokenizer", "--vocab-size")


@pytest.mark.parametrize("split", ["a,b,c", "1,2,3,4", "0,0,0", "-1,1,1", "90,,5"])
def test_bad_split(parse, split):
    expect_error(parse(f"--split={split}"), 1, f"--split={split}", "969,30,1")


@pytest.mark.parametrize("split, flags", [("90,5,5", ()), ("100", ("--eval-iters", "0")), ("98,2", ()),
                                          ("969, 30, 1", ()), ("100,0,0", ("--eval-interval", "500"))])
def test_good_split(parse, split, flags):
    assert validate_args(parse("--split", split, *flags), 1).split == split


@pytest.mark.parametrize("split, fragment", [
    ("100,0,0", "gives the validation set no data while evaluation is on (--eval-interval 100, --eval-iters 5)"),
    ("100", "valid: a positive second proportion (e.g. 98,2,0), or --eval-iters 0"),
    ("0,50,50", "gives the training set no data"),
])
def test_a_split_without_the_data_a_run_reads_is_refused(parse, split, fragment):
    # the validation set is read only when an evaluation happens (every 100 of the 200 iterations here)
    expect_error(parse("--split", split), 1, f"--split={split}", fragment)


def test_a_mode_is_one_registry_line_with_its_own_flags_and_rules(parse, monkeypatch):
    expect_error(parse("--moe-parallel-mode", "swift"), 1, "--moe-parallel-mode=swift",
                 "valid: ep, fssdp, replicate, zebra")

    def add_args(parser):
        parser.add_argument_group(title="swift").add_argument("--swift-knob", type=int, default=3)

    def validate(args):
        if args.swift_knob > 5:
            fail("--swift-knob", args.swift_knob, "valid: at most 5")
        args.swift_validated = True

    monkeypatch.setitem(modes.MODES, "swift", ModeSpec("swift", "test mode", "tests:Nothing", add_args, validate))
    args = validate_args(parse("--moe-parallel-mode", "swift", "--swift-knob", "4"), 1)
    assert (args.moe_parallel_mode, args.swift_knob, args.swift_validated) == ("swift", 4, True)
    expect_error(parse("--moe-parallel-mode", "swift", "--swift-knob", "6"), 1, "--swift-knob=6", "valid: at most 5")
    # its flags are refused in another mode, and the other modes' flags in it
    expect_error(parse("--swift-knob", "4"), 1, "--swift-knob=4", "only applies with --moe-parallel-mode swift (mode is ep)")
    expect_error(parse("--moe-parallel-mode", "swift", "--no-fssdp-calibrate"), 4, "--fssdp-calibrate=False",
                 "only applies with --moe-parallel-mode fssdp (mode is swift)")
    # it places experts statically (no default_load_window), so the load window is refused
    expect_error(parse("--moe-parallel-mode", "swift", "--moe-load-window", "2"), 1, "--moe-load-window=2",
                 "only applies with --moe-parallel-mode fssdp or replicate")


ZEBRA_2_2_4 = ("--moe-parallel-mode", "zebra", "--zebra-attention-ranks", "2", "--zebra-expert-ranks", "2",
               "--zebra-microbatches", "4")


def test_zebra_resolves_ep_1_and_the_batch_of_its_attention_ranks(parse):
    args = validate_args(parse(*ZEBRA_2_2_4, "--micro-batch-size", "3"), 8)
    # 2 ZP groups of 2 + 2: 4 attention ranks read data, 4 micro-batches each
    assert (args.expert_model_parallel_size, args.data_parallel_size) == (1, 4)
    assert (args.global_batch_size, args.num_micro_batches) == (3 * 4 * 4, 4)
    assert validate_args(parse(*ZEBRA_2_2_4, "--zebra-asym-ea", "1,0,2,1"), 4).zebra_asym_ea == "1,0,2,1"


@pytest.mark.parametrize("flags, world, fragments", [
    (("--moe-parallel-mode", "zebra"), 4, ("--zebra-attention-ranks=None", "required with --moe-parallel-mode zebra")),
    ((), 6, ("world size 6 is not divisible by M + N = 2 + 2 = 4", "multiples of 4")),
    (("--zebra-expert-ranks", "3"), 5, ("--zebra-expert-ranks=3 does not divide the 8 experts", "valid: [1, 2, 4, 8]")),
    (("--zebra-attention-ranks", "3", "--zebra-asym-ea", "auto"), 5, ("--zebra-asym-ea=auto needs --zebra-profile",)),
    (("--zebra-attention-ranks", "3", "--zebra-asym-ea", "1,1,1,1"), 5, ("needs M to divide N or N to divide M",)),
    (("--zebra-asym-ea", "1,x"), 4, ("--zebra-asym-ea='1,x' is invalid",)),
    (("--zebra-replan-interval", "5"), 4, ("--zebra-replan-interval=5 needs --zebra-profile FILE",)),
    (("--zebra-replan-interval", "-1"), 4, ("--zebra-replan-interval=-1 is invalid", "integer >= 0")),
    # any existing file passes the flag's check; M = 3 with N = 2 fails before the profile is read
    (("--zebra-attention-ranks", "3", "--zebra-replan-interval", "2", "--zebra-profile", __file__), 5,
     ("--zebra-replan-interval needs M to divide N or N to divide M", "--zebra-attention-ranks=3")),
    (("--global-batch-size", "16"), 4, ("--global-batch-size=16", "valid: 32 (or leave it unset)")),
    (("--expert-model-parallel-size", "2"), 4, ("--expert-model-parallel-size=2", "--zebra-expert-ranks", "valid: 1")),
    (("--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"), 4,
     ("--tensor-model-parallel-size=2", "valid: 1")),
    (("--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type", "global_aux_loss"), 4,
     ("--moe-router-load-balancing-type=global_aux_loss", "expert ranks", "valid: aux_loss or seq_aux_loss")),
    (("--use-distributed-optimizer",), 4, ("--use-distributed-optimizer=True", "zebra has its own optimizer")),
    (("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"), 4,
     ("--recompute-num-layers=2", "segments apart", "valid: 1, or --recompute-method block N")),
    (("--recompute-granularity", "selective", "--recompute-modules", "core_attn", "layernorm"), 4,
     ("--recompute-modules=core_attn layernorm", "valid: core_attn")),
    (("--zebra-cluster", "nowhere"), 4, ("--zebra-cluster nowhere", "unknown cluster config", "zebra_o1")),
    # zebra_o1 = 6 A40 then 6 V100: 12 ranks, M = N = 6 -> 8 experts do not divide over 6 expert ranks
    (("--zebra-cluster", "zebra_o1", "--zebra-attention-ranks", "6", "--zebra-expert-ranks", "6"), 12,
     ("--zebra-expert-ranks=6 does not divide the 8 experts",)),
    (("--zebra-cluster", "zebra_o1", "--zebra-attention-ranks", "4", "--zebra-expert-ranks", "8"), 12,
     ("8 V100-SXM2-16GB devices", "has 6")),
])
def test_zebra_refusals_name_the_value_and_what_is_valid(parse, flags, world, fragments):
    base = ZEBRA_2_2_4 if "--moe-parallel-mode" not in flags else ()
    expect_error(parse(*base, *flags), world, *fragments)


def test_zebra_saves_checkpoints(parse):
    assert validate_args(parse(*ZEBRA_2_2_4, "--save", "/tmp/x", "--save-interval", "5"), 4).save == "/tmp/x"


def test_zebra_takes_dense_layers(parse):
    # dense layers run on the attention ranks (trained against ep: tests/training/test_model_configs_train.py)
    assert validate_args(parse(*ZEBRA_2_2_4, "--moe-layer-freq", "2"), 4).moe_layer_freq == 2


def test_zebra_flags_only_apply_in_zebra_mode(parse):
    expect_error(parse("--zebra-microbatches", "4"), 4,
                 "--zebra-microbatches=4", "only applies with --moe-parallel-mode zebra (mode is ep)")


def test_replicate_defaults_and_refusals(parse):
    args = validate_args(parse("--moe-parallel-mode", "replicate"), 4)
    assert (args.replicate_slots_per_rank, args.replicate_policy, args.moe_load_window) == (4, "adaptive", 1)
    assert args.expert_model_parallel_size == 4 and args.expert_data_parallel_size == 1
    args = validate_args(parse("--moe-parallel-mode", "replicate", "--replicate-policy", "periodic",
                               "--replicate-rebalance-interval", "50", "--moe-expert-capacity-factor", "1.0"), 4)
    assert (args.replicate_policy, args.replicate_rebalance_interval, args.moe_expert_capacity_factor) == ("periodic", 50, 1.0)
    # tiny has 8 experts: 4 ranks x 1 slot cannot hold them
    expect_error(parse("--moe-parallel-mode", "replicate", "--replicate-slots-per-rank", "1"), 4,
                 "--replicate-slots-per-rank=1", "--num-experts=8 > ranks x slots = 4 x 1", "valid: >= 2")
    expect_error(parse("--moe-parallel-mode", "replicate", "--replicate-policy", "best"), 4,
                 "--replicate-policy=best", "valid: adaptive, static, periodic")
    expect_error(parse("--moe-parallel-mode", "replicate", "--replicate-rebalance-interval", "50"), 4,
                 "--replicate-rebalance-interval=50", "only applies with --replicate-policy periodic")
    args = parse("--moe-parallel-mode", "replicate", "--use-distributed-optimizer", "--save", "/tmp/x", "--save-interval", "5")
    assert validate_args(args, 4).use_distributed_optimizer
    assert validate_args(parse("--moe-parallel-mode", "replicate", "--save", "/tmp/x", "--save-interval", "5"), 4).save == "/tmp/x"
    expect_error(parse("--replicate-slots-per-rank", "2"), 4,
                 "--replicate-slots-per-rank=2", "only applies with --moe-parallel-mode replicate (mode is ep)")
    expect_error(parse("--moe-parallel-mode", "fssdp", "--replicate-offload-optimizer"), 4,
                 "--replicate-offload-optimizer=True", "only applies with --moe-parallel-mode replicate (mode is fssdp)")
    expect_error(parse("--moe-load-window", "2"), 4, "--moe-load-window=2", "fssdp or replicate (mode is ep")


def test_fssdp_defaults_and_values(parse):
    args = validate_args(parse("--moe-parallel-mode", "fssdp"), 4)
    assert (args.fssdp_overlap_degree, args.fssdp_memory_capacity) == ("auto", "auto")
    assert args.moe_load_window == 5 and args.fssdp_reshard_interval == 100
    assert args.expert_model_parallel_size == 4 and args.expert_data_parallel_size == 1
    args = validate_args(parse("--moe-parallel-mode", "fssdp", "--fssdp-overlap-degree", "3",
                               "--fssdp-memory-capacity", "0", "--moe-load-window", "1"), 4)
    assert (args.fssdp_overlap_degree, args.fssdp_memory_capacity, args.moe_load_window) == (3, 0, 1)


@pytest.mark.parametrize("mode", ["fssdp", "replicate"])
def test_instance_modes_accept_more_ranks_than_an_expert_group(parse, mode):
    """EP 2 on 4 ranks: two expert groups (expert-data-parallel 2), sharded inside each group."""
    args = validate_args(parse("--moe-parallel-mode", mode, "--expert-model-parallel-size", "2"), 4)
    assert (args.expert_model_parallel_size, args.expert_data_parallel_size) == (2, 2)


@pytest.mark.parametrize("flags,world,fragments", [
    (["--fssdp-rematerialize"], 4, ["--fssdp-rematerialize=True", "only applies with --moe-parallel-mode fssdp"]),
    (["--fssdp-overlap-degree", "2"], 4, ["--fssdp-overlap-degree=2", "(mode is ep)"]),
    (["--moe-load-window", "3"], 4, ["--moe-load-window=3", "only applies"]),
    (["--moe-parallel-mode", "fssdp", "--moe-load-window", "0"], 4, ["--moe-load-window=0", "at least 1"]),
    (["--moe-parallel-mode", "fssdp", "--fssdp-reshard-interval", "-1"], 4, ["--fssdp-reshard-interval=-1", ">= 0"]),
    (["--moe-parallel-mode", "fssdp", "--fssdp-memory-budget-mb", "0"], 4, ["--fssdp-memory-budget-mb=0", "positive"]),
    (["--moe-parallel-mode", "fssdp"], 1,
     ["--expert-model-parallel-size=1", "at least 2", "use --moe-parallel-mode ep"]),
    (["--moe-parallel-mode", "fssdp", "--moe-token-dispatcher-type", "allgather"], 4,
     ["--moe-token-dispatcher-type=allgather", "valid: alltoall"]),
    (["--moe-load-predictor", "mean"], 4, ["--moe-load-predictor=mean", "only applies", "places experts statically"]),
])
def test_fssdp_refusals(parse, flags, world, fragments):
    expect_error(parse(*flags), world, *fragments)


@pytest.mark.parametrize("value", ["-1", "many", "2.5"])
def test_fssdp_auto_or_int_flags_reject_bad_values(value):
    with pytest.raises(ArgumentError, match="--fssdp-overlap-degree"):
        A.parse_args(["--fssdp-overlap-degree", value])


def test_model_family(parse):
    expect_error(parse("--model-family", "t5"), 1, "--model-family=t5", "gpt, bert")


def test_load_directory_missing(parse, tmp_path):
    missing = tmp_path / "ckpt"
    expect_error(parse("--load", str(missing)), 1, f"--load={missing}", "not found")
    # --save DIR --load DIR: resume when a checkpoint exists, else start fresh.
    validate_args(parse("--load", str(missing), "--save", str(missing), "--save-interval", "10"), 1)
    missing.mkdir()
    validate_args(parse("--load", str(missing), "--save", str(missing), "--save-interval", "10"), 1)
    # any other directory must hold a checkpoint: a typo must not silently train from scratch
    expect_error(parse("--load", str(missing)), 1, f"--load={missing}",
                 "holds no checkpoint (no latest_checkpointed_iteration.txt)")
    (missing / "latest_checkpointed_iteration.txt").write_text("release\n")
    expect_error(parse("--load", str(missing)), 1, f"--load={missing}", "holds 'release', expected an iteration number")
    # the --save directory's tracker is read up front too, not at the load
    expect_error(parse("--load", str(missing), "--save", str(missing), "--save-interval", "10"), 1,
                 f"--load={missing}", "holds 'release', expected an iteration number")
    (missing / "latest_checkpointed_iteration.txt").write_text("20\n")
    expect_error(parse("--load", str(missing)), 1, f"--load={missing}",
                 f"no checkpoint verifies: {missing / 'iter_0000020'} does not exist")
    (missing / "iter_0000020").mkdir()  # as Megatron-LM writes it: no manifest, loaded unverified
    (missing / "iter_0000020" / checkpoint_dirs.DIST_METADATA_FILE).write_text('{"sharded_backend": "torch_dist"}')
    args = validate_args(parse("--load", str(missing)), 1)
    assert args.load_iteration == 20 and args.load_notes == [
        f"{missing / 'iter_0000020'} has no manifest.json (not written by this version): loaded without verification"]
    # nothing left to train is an error, not "0 iterations, loss nan" and exit 0
    for train_iters in ("20", "10"):
        expect_error(parse("--load", str(missing), "--train-iters", train_iters), 1, f"--train-iters={train_iters}",
                     f"the checkpoint in {missing} is at iteration 20", "valid: more than 20")


def test_a_resume_refuses_another_model_shape_and_reports_every_other_change(parse, tmp_path):
    from megatron_patches.training import resume

    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000020").mkdir(parents=True)
    (ckpt / "iter_0000020" / checkpoint_dirs.DIST_METADATA_FILE).write_text('{"sharded_backend": "torch_dist"}')
    (ckpt / "latest_checkpointed_iteration.txt").write_text("20\n")
    saving = validate_args(parse("--train-iters", "20"), 4)
    # the loop fills these for the embedded corpus after validation (resolve_default_corpus)
    saving.tokenizer_type, saving.data_path = "GPT2BPETokenizer", ["data/austen-gpt-v1/austen_text_document"]
    resume.write_flags(ckpt / "iter_0000020", saving)
    same = validate_args(parse("--load", str(ckpt), "--train-iters", "20", "--train-iters", "30"), 4)
    # validation derives --lr-decay-iters from --train-iters: the decay length stays the checkpoint's
    decay = ("--lr-decay-iters 20 -> 30: not applied, the LR schedule continues from the checkpoint's "
             "(--override-opt_param-scheduler applies it)")
    assert same.resume_changes == ["--train-iters 20 -> 30: applied", decay]
    changed = validate_args(parse("--load", str(ckpt), "--train-iters", "30", "--lr", "5e-4", "--log-interval", "5",
                                  "--save", str(tmp_path / "elsewhere"), "--save-interval", "10"), 4)
    assert changed.resume_changes == [
        "--train-iters 20 -> 30: applied",
        "--lr 0.001 -> 0.0005: not applied, the LR schedule continues from the checkpoint's (--override-opt_param-"
        "scheduler applies it)",
        decay,
        "--save-interval None -> 10: applied",
        "--log-interval 10 -> 5: applied",
    ]
    overridden = validate_args(parse("--load", str(ckpt), "--train-iters", "30", "--lr", "5e-4",
                                     "--override-opt_param-scheduler"), 4)
    assert overridden.resume_changes == [
        "--train-iters 20 -> 30: applied",
        "--lr 0.001 -> 0.0005: applied (--override-opt_param-scheduler)",
        "--lr-decay-iters 20 -> 30: applied (--override-opt_param-scheduler)",
    ]
    # the optimizer's form cannot change while its state is loaded
    expect_error(parse("--load", str(ckpt), "--train-iters", "30", "--use-distributed-optimizer"), 4,
                 "--use-distributed-optimizer=True", "was saved with use_distributed_optimizer False",
                 "valid: False, or --no-load-optim")
    fresh = validate_args(parse("--load", str(ckpt), "--train-iters", "30", "--use-distributed-optimizer",
                                "--no-load-optim"), 4)
    assert "--use-distributed-optimizer False -> True: applied" in fresh.resume_changes
    assert "--lr-decay-iters 20 -> 30: applied (--no-load-optim: the LR schedule starts afresh)" in fresh.resume_changes
    # saved with EP 4: the experts' Adam state is apart from the dense parameters' (chained_1.); EP 1 keeps it
    # with them, so the state does not load (a KeyError inside Megatron-Core, measured); zebra writes EP 4's form
    expect_error(parse("--load", str(ckpt), "--train-iters", "30", "--expert-model-parallel-size", "1"), 4,
                 "--expert-model-parallel-size=1", "was saved with expert_model_parallel_size 4",
                 "valid: > 1 (or zebra), or --no-load-optim")
    assert validate_args(parse("--load", str(ckpt), "--train-iters", "30", "--expert-model-parallel-size", "1",
                               "--no-load-optim"), 4).load_iteration == 20
    zebra = ["--moe-parallel-mode", "zebra", "--zebra-attention-ranks", "2", "--zebra-expert-ranks", "2",
             "--zebra-microbatches", "2"]
    assert validate_args(parse("--load", str(ckpt), "--train-iters", "30", *zebra), 4).load_iteration == 20
    expect_error(parse("--load", str(ckpt), "--train-iters", "30", "--num-layers", "6"), 4, "--num-layers=6",
                 f"the checkpoint in {ckpt} (iteration 20) was saved with num_layers 4", "valid: 4, or no --load")
    # the vocabulary pads to a multiple of --make-vocab-size-divisible-by x TP: another TP changes
    # the padding (reported with the value that keeps it), the same padding by another split does not
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"]
    padded = validate_args(parse("--load", str(ckpt), "--train-iters", "30", *tp2), 4).resume_changes
    assert ("vocabulary padding: to a multiple of 256 (was 128; --make-vocab-size-divisible-by x TP): the rows both "
            "have are loaded, the padding rows differ and move the losses slightly; --make-vocab-size-divisible-by 64 "
            "keeps the checkpoint's padding") in padded
    kept = validate_args(parse("--load", str(ckpt), "--train-iters", "30", *tp2, "--make-vocab-size-divisible-by", "64"),
                         4).resume_changes
    assert "--make-vocab-size-divisible-by 128 -> 64: applied" in kept and not any("padding" in line for line in kept)
    (ckpt / "iter_0000020" / resume.FLAGS_FILE).unlink()  # a checkpoint from before flags were kept
    assert validate_args(parse("--load", str(ckpt), "--train-iters", "30"), 4).resume_changes == [
        f"{ckpt / 'iter_0000020'} holds no flags.json: flags not compared"]


def test_save_needs_save_interval(parse, tmp_path):
    expect_error(parse("--save", str(tmp_path)), 1, f"--save={tmp_path}", "--save-interval")


@pytest.mark.parametrize("flag", ["--log-interval", "--eval-interval", "--save-interval"])
@pytest.mark.parametrize("value", ["0", "-10"])
def test_intervals_must_be_positive(parse, flag, value):
    expect_error(parse(flag, value), 1, f"{flag}={value}", "positive")


def test_negative_learning_rate(parse):
    expect_error(parse("--lr", "-0.001"), 1, "--lr=-0.001")


def test_min_lr_above_lr(parse):
    expect_error(parse("--lr", "0.001", "--min-lr", "0.01"), 1, "--min-lr=0.01", "--lr=0.001")


def test_warmup_not_below_decay(parse):
    expect_error(parse("--train-iters", "10", "--lr-warmup-iters", "10"), 1,
                 "--lr-warmup-iters=10", "--lr-decay-iters=10", "0..9")


def test_unknown_lr_decay_style(parse):
    expect_error(parse("--lr-decay-style", "cosin"), 1, "--lr-decay-style=cosin", "cosine")


@pytest.mark.parametrize("value", ["0", "-1"])
def test_capacity_factor_must_be_positive(parse, value):
    expect_error(parse("--moe-expert-capacity-factor", value), 1,
                 f"--moe-expert-capacity-factor={float(value)}")


def test_padding_to_capacity_needs_a_capacity(parse):
    expect_error(parse("--moe-pad-expert-input-to-capacity"), 1,
                 "--moe-pad-expert-input-to-capacity", "--moe-expert-capacity-factor")


def test_capacity_with_sinkhorn(parse):
    expect_error(parse("--moe-expert-capacity-factor", "1.0",
                       "--moe-router-load-balancing-type", "sinkhorn"), 1,
                 "--moe-router-load-balancing-type=sinkhorn")


def test_unknown_load_balancing_type(parse):
    expect_error(parse("--moe-router-load-balancing-type", "aux"), 1,
                 "--moe-router-load-balancing-type=aux", "aux_loss")


def test_unknown_dispatcher_type(parse):
    expect_error(parse("--moe-token-dispatcher-type", "all2all"), 1,
                 "--moe-token-dispatcher-type=all2all", "alltoall, allgather, flex")


def test_flex_dispatcher_needs_cuda(parse):
    expect_error(parse("--moe-token-dispatcher-type", "flex", "--cpu"), 2,
                 "--moe-token-dispatcher-type=flex", "CUDA")


def test_device_dependent_backends(parse):
    expect_error(parse("--cpu", "--distributed-backend", "nccl"), 1,
                 "--distributed-backend=nccl", "gloo")
    expect_error(parse("--cpu", "--transformer-impl", "transformer_engine"), 1,
                 "--transformer-impl=transformer_engine", "local")
    expect_error(parse("--distributed-backend", "mpi"), 1, "--distributed-backend=mpi")
    args = validate_args(parse("--cpu"), 1)
    assert (args.use_cuda, args.distributed_backend, args.transformer_impl) == (False, "gloo", "local")


def test_cpu_flag_never_queries_cuda(parse, monkeypatch):
    import torch

    def refuse():
        raise AssertionError("--cpu must not initialise CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", refuse)
    assert validate_args(parse("--cpu"), 1).use_cuda is False


@pytest.mark.parametrize("flag, value", [("--normalization", "BatchNorm"),
                                         ("--position-embedding-type", "alibi")])
def test_unknown_model_choices(parse, flag, value):
    expect_error(parse(flag, value), 1, f"{flag}={value}")


def test_bad_world_size(parse):
    for world in (0, -1, 2.0):
        expect_error(parse(), world, "world size")


# ---------------------------------------------------------------------------------------------
# Megatron-Core cross-checks (read from the installed source, not imported: importing
# megatron.core takes several seconds)
# ---------------------------------------------------------------------------------------------


def _build_tokenizer_source():
    path = importlib.metadata.distribution("megatron-core").locate_file(
        "megatron/core/tokenizers/text/utils/build_tokenizer.py")
    return ast.parse(Path(path).read_text())


def test_tokenizer_types_are_those_megatron_core_build_tokenizer_supports():
    tree = _build_tokenizer_source()
    supported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            supported.update(element.value for element in node.value.elts)
        if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute)
                and node.left.attr == "tokenizer_type"):
            supported.update(c.value for c in node.comparators if isinstance(c, ast.Constant))
    assert supported == set(A.TOKENIZER_TYPES)


def test_namespace_has_every_attribute_build_tokenizer_reads(parse):
    read = {node.attr for node in ast.walk(_build_tokenizer_source())
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "args"}
    assert read and read <= set(vars(validate_args(parse("--mock-data"), 1)))


# ---------------------------------------------------------------------------------------------
# Printing and documentation
# ---------------------------------------------------------------------------------------------


def test_docs_flags_md_is_in_sync_with_the_parser():
    docs = A.REPO_ROOT / "docs" / "flags.md"
    assert docs.read_text() == flag_reference_markdown(), (
        "docs/flags.md is stale: python -m megatron_patches.training.flag_docs > docs/flags.md")


def test_flag_reference_lists_every_flag_and_dest():
    text = flag_reference_markdown()
    for action in build_parser()._actions:
        if action.dest == "help":
            continue
        assert f"`{action.option_strings[0]}`" in text
        assert action.dest == "config" or f"`{action.dest}`" in text
    for name in A.DERIVED_VALUES:
        assert f"`{name}`" in text


def test_describe_args_lists_every_dest_grouped(parse):
    args = validate_args(parse("--tensorboard-dir", "tb"), 4)
    args.set_by_someone_else = 3
    text = describe_args(args)
    for dest, value in vars(args).items():
        line = next(line for line in text.splitlines() if line.startswith(f"  {dest} ."))
        assert line.endswith(flag_docs._show(value))
    titles = [line for line in text.splitlines() if line and not line.startswith((" ", "-"))]
    assert titles[:4] == ["config:", "model:", "multi-latent attention and multi-token prediction:", "moe:"]
    assert titles[-2:] == ["derived (validate_args):", "other:"]
    # Sorted within a group.
    model_lines = text.split("model:\n")[1].split("\nmulti-latent attention")[0].splitlines()
    names = [line.split()[0] for line in model_lines]
    assert names == sorted(names)


def test_attention_and_norm_flags_follow_megatron_lm_s_rules(parse):
    # the deprecated rope switch sets the type; linear biases include the QKV projection's
    rope = validate_args(parse("--use-rotary-position-embeddings", "--rotary-percent", "0.5"), 1)
    assert rope.position_embedding_type == "rope" and rope.rotary_percent == 0.5 and rope.add_qkv_bias is True
    assert validate_args(parse("--disable-bias-linear"), 1).add_qkv_bias is False
    assert validate_args(parse("--disable-bias-linear", "--add-qkv-bias"), 1).add_qkv_bias is True
    for flags in (("--rotary-percent", "0.5"), ("--rotary-interleaved",), ("--rotary-seq-len-interpolation-factor", "2")):
        expect_error(parse(*flags), 1, f"{flags[0]}=", "--position-embedding-type=learned_absolute does not use",
                     "add --position-embedding-type rope")
    expect_error(parse("--position-embedding-type", "rope", "--rotary-percent", "1.5"), 1, "--rotary-percent=1.5",
                 "(0, 1]")
    expect_error(parse("--norm-epsilon", "0"), 1, "--norm-epsilon=0.0", "(0, 1)")
    expect_error(parse("--model-family", "bert", "--qk-layernorm"), 1, "--qk-layernorm=True", "BERT layer spec")
    assert validate_args(parse("--qk-layernorm", "--norm-epsilon", "1e-6"), 1).layernorm_epsilon == 1e-6


def test_routing_flags_follow_megatron_core_s_checks_in_every_mode(parse):
    deepseek = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-num-groups",
                "4", "--moe-router-group-topk", "2", "--moe-router-dtype", "fp32"]
    args = validate_args(parse(*deepseek), 1)
    assert (args.moe_router_score_function, args.moe_router_group_topk, args.moe_router_dtype) == ("sigmoid", 2, "fp32")
    expect_error(parse("--moe-router-enable-expert-bias"), 1, "--moe-router-enable-expert-bias=True",
                 "needs --moe-router-score-function sigmoid (is softmax)")
    expect_error(parse("--moe-router-num-groups", "4"), 1, "--moe-router-num-groups=4", "--moe-router-group-topk")
    expect_error(parse("--moe-router-group-topk", "2"), 1, "--moe-router-group-topk=2", "--moe-router-num-groups")
    expect_error(parse("--moe-router-num-groups", "3", "--moe-router-group-topk", "1"), 1,
                 "--moe-router-num-groups=3", "must divide --num-experts=8", "[1, 2, 4, 8]")
    # top-2 of 8 experts in 4 groups of 2: group-topk 1 or 2 (3 and 4 exceed the top-k)
    expect_error(parse("--moe-router-num-groups", "4", "--moe-router-group-topk", "3"), 1,
                 "--moe-router-group-topk=3", "valid: [1, 2]")
    expect_error(parse("--moe-router-dtype", "bf16"), 1, "--moe-router-dtype=bf16", "valid: fp32, fp64")
    expect_error(parse("--moe-router-score-function", "relu"), 1, "--moe-router-score-function=relu", "sigmoid")
    expect_error(parse("--moe-z-loss-coeff", "0"), 1, "--moe-z-loss-coeff=0.0", "must be positive")
    expect_error(parse("--moe-router-bias-update-rate", "0.01"), 1, "--moe-router-bias-update-rate=0.01",
                 "read only with --moe-router-enable-expert-bias")
    expect_error(parse("--moe-token-drop-policy", "position"), 1, "--moe-token-drop-policy=position",
                 "read only with --moe-expert-capacity-factor")
    validate_args(parse("--moe-token-drop-policy", "position", "--moe-expert-capacity-factor", "1.0"), 1)
    for mode in ("fssdp", "replicate"):  # trained against ep: tests/training/test_modern_moe_modes.py
        validate_args(parse("--moe-parallel-mode", mode, "--expert-model-parallel-size", "4", *deepseek), 4)
    validate_args(parse("--moe-parallel-mode", "zebra", "--zebra-attention-ranks", "2", "--zebra-expert-ranks", "2",
                        "--zebra-microbatches", "2", *deepseek), 4)


def test_sample_based_training_and_warmup_flags(parse):
    # --train-samples on the command line replaces the config's train_iters (RUN's 200)
    args = parse("--train-samples", "100", "--global-batch-size", "8", "--lr-warmup-samples", "20",
                 "--lr-decay-samples", "60")
    assert args.train_iters is None
    args = validate_args(args, 1)
    # Megatron-LM: train-samples // global batch iterations; the schedule's samples as iterations
    assert args.train_iters == 12 and args.lr_warmup_steps == 2.5 and args.lr_decay_steps == 7.5
    expect_error(parse("--train-samples", "100", "--train-iters", "5"), 1, "--train-samples=100",
                 "either it or --train-iters (is 5)")
    expect_error(parse("--train-samples", "2"), 1, "--train-samples=2", "less than one global batch (4)")
    expect_error(parse("--lr-warmup-samples", "8"), 1, "--lr-warmup-samples=8", "use --lr-warmup-iters")
    fraction = validate_args(parse("--lr-warmup-fraction", "0.1", "--lr-warmup-init", "1e-4"), 1)
    assert fraction.lr_warmup_steps == pytest.approx(20) and fraction.lr_warmup_init == 1e-4
    expect_error(parse("--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"), 1, "--lr-warmup-fraction=0.1",
                 "excludes --lr-warmup-iters")
    expect_error(parse("--lr-warmup-init", "0.5"), 1, "--lr-warmup-init=0.5", "<= --lr=0.001")
    expect_error(parse("--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler"), 1,
                 "--use-checkpoint-opt_param-scheduler=True", "excludes --override-opt_param-scheduler")
    expect_error(parse("--manual-gc-interval", "5"), 1, "--manual-gc-interval=5", "read only with --manual-gc")
    assert validate_args(parse("--manual-gc", "--manual-gc-interval", "5", "--no-manual-gc-eval"), 1).manual_gc_eval is False
    assert parse("--exit-signal", "SIGUSR1").exit_signal is signal.SIGUSR1
    with pytest.raises(ArgumentError, match="'TERM' is not a signal name; valid: SIGTERM, SIGINT, SIGUSR1, SIGUSR2"):
        parse("--exit-signal", "TERM")
    expect_error(parse("--exit-interval", "0"), 1, "--exit-interval=0", "must be a positive integer")


def test_the_iteration_schedule_equals_megatron_lm_s_sample_schedule():
    """Megatron-LM steps its scheduler by the global batch in samples; validation's conversion to
    (fractional) iterations gives the same learning rate at every iteration."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs, train_samples, warmup_samples, decay_samples = 12, 600, 50, 500

    def lrs(warmup, decay, increment):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        sched = OptimizerParamScheduler(opt, init_lr=1e-5, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=warmup,
                                        lr_decay_steps=decay, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=decay, wd_incr_style="constant")
        out = []
        for _ in range(train_samples // gbs):
            out.append(opt.param_groups[0]["lr"])
            sched.step(increment=increment)
        return out

    megatron_lm = lrs(warmup_samples, decay_samples, gbs)
    ours = lrs(warmup_samples / gbs, decay_samples / gbs, 1)
    np.testing.assert_allclose(ours, megatron_lm, rtol=1e-12)
    assert megatron_lm[1] < megatron_lm[4] and megatron_lm[-1] == 1e-4  # warm-up, then decayed to min


def test_model_flops_are_megatron_lm_s_count():
    """training/flops.py against the count written out per token for the tiny job (2 MoE layers,
    hidden 64, 4 heads of 16, FFN 128, 8 experts top-2, sequence 128, GPT-2 vocabulary padded to
    50,304, global batch 4) and for a GQA + SwiGLU model with a dense layer."""
    from megatron_patches.training.flops import model_flops_per_iteration

    tiny = validate_args(parse_args([]), 1)
    attention = 6 * (64 * (64 + 2 * 64) + 64 * 128 + 64 * 64)  # QKV, scores + values (causal half), output
    experts = 6 * 64 * (128 * 2 * 2)  # top-2 experts, fc1 + fc2
    logits = 6 * 64 * 50304
    assert model_flops_per_iteration(tiny, 50304) == 4 * 128 * (2 * (attention + experts) + logits)
    gqa = validate_args(parse_args(["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
                                    "--group-query-attention", "--num-query-groups", "2", "--swiglu",
                                    "--ffn-hidden-size", "256", "--moe-ffn-hidden-size", "64", "--num-experts", "8",
                                    "--moe-router-topk", "2", "--moe-layer-freq", "2", "--seq-length", "32",
                                    "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-4"]), 1)
    attention = 6 * (128 * (128 + 2 * 32 * 2) + 128 * 32 + 128 * 128)
    mlp = 6 * 128 * (256 * 3 * 1 + 64 * 2 * 3 * 1)  # one dense SwiGLU layer, one MoE layer of top-2
    assert model_flops_per_iteration(gqa, 1024) == 2 * 32 * (2 * attention + mlp + 6 * 128 * 1024)
    # DeepSeek-V3's kind: multi-latent attention with a query latent, a shared expert, a dense first
    # layer, one MTP layer (it repeats the last, MoE, layer and adds norms, a 2h -> h projection and logits)
    deepseek = validate_args(parse_args([
        "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--multi-latent-attention",
        "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
        "--v-head-dim", "8", "--position-embedding-type", "rope", "--swiglu", "--ffn-hidden-size", "192",
        "--moe-ffn-hidden-size", "32", "--num-experts", "8", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1,1]",
        "--moe-shared-expert-intermediate-size", "48", "--disable-bias-linear", "--mtp-num-layers", "1",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-4"]), 1)
    attention = 6 * (24 * (64 + 4 * 12 + 1) + 16 * (64 + 4 * (8 + 8) + 1) + 64 * 4 + 4 * 8 * 64
                     + 32 * 4 * 12 / 2 + 32 * 4 * 8 / 2)
    mlp = 6 * 64 * (192 * 3 * 1 + (32 * 2 + 48) * 3 * 3)  # one dense layer; two MoE layers and the MTP layer
    mtp = 6 * (3 * 64 + 2 * 64 * 64)
    assert model_flops_per_iteration(deepseek, 1024) == 2 * 32 * (4 * attention + mlp + mtp + 2 * 6 * 64 * 1024)


def test_params_norm_and_zero_count_run_in_every_mode(parse):
    validate_args(parse("--log-params-norm", "--log-num-zeros-in-grad"), 1)
    for mode in ("fssdp", "replicate"):
        validate_args(parse("--moe-parallel-mode", mode, "--log-params-norm", "--log-num-zeros-in-grad"), 4)
    validate_args(parse("--moe-parallel-mode", "zebra", "--expert-model-parallel-size", "1", "--zebra-attention-ranks",
                        "2", "--zebra-expert-ranks", "2", "--zebra-microbatches", "2", "--log-params-norm",
                        "--log-num-zeros-in-grad"), 4)


def test_timing_log_level_zero_only(parse):
    assert validate_args(parse("--timing-log-level", "0"), 1).timing_log_level == 0
    expect_error(parse("--timing-log-level", "1"), 1, "--timing-log-level=1", "valid: 0")


def test_dist_ckpt_strictness_choices_are_megatron_core_s():
    """validation's torch-free copy of dist_checkpointing's StrictHandling values."""
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megatron_patches.training.validation import DIST_CKPT_STRICTNESS

    assert DIST_CKPT_STRICTNESS == tuple(handling.value for handling in StrictHandling)
