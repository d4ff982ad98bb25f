"""The zebra profiler (tools/profile_moe.py, megatron_patches/zebra/profiler.py) on CPU.

- every bad flag fails before any work, naming the flag and what is valid;
- the measured attention block is exactly the non-expert part of Megatron's MoE TransformerLayer
  (block + the layer's own experts reproduce the layer's output and input gradient);
- two device types profiled into one file (the tool as a user runs it, then in-process), loaded
  with load_zebra_profile and fed to resolve_asym_ea("auto"); the slots follow exactly from the
  stored byte figures; a file of another shape or workload is refused before profiling.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megatron_patches.config import count_parameters, expert_parameter_count, load_model_config, model_config_from_dict
from megatron_patches.placement.zebra import ZebraShape, load_zebra_profile, resolve_asym_ea
from megatron_patches.zebra.profiler import ProfileRequest, bytes_per_parameter

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "profile_moe.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("profile_moe_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_flags(out, **overrides) -> list[str]:
    flags = {
        "--model-config": "tiny", "--microbatches": "4", "--attention-ranks": "2", "--expert-ranks": "2",
        "--seq-length": "32", "--micro-batch-size": "2", "--device": "cpu", "--device-type": "cpu-a",
        "--role": "both", "--out": str(out), "--repeats": "3", "--warmup": "1", "--memory-gb": "0.05",
    }
    flags.update(overrides)
    return [item for key, value in flags.items() if value is not None for item in (key, value)]


# ------------------------------------------------------------------------------------------
# Bad flags
# ------------------------------------------------------------------------------------------


def write_model(tmp_path, name, **changes) -> str:
    values = yaml.safe_load((REPO / "configs" / "models" / "tiny.yaml").read_text())
    values.update(changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


BAD_FLAGS = [
    ({"--microbatches": "0"}, "--microbatches=0 is invalid; expected an integer >= 1"),
    ({"--attention-ranks": "0"}, "--attention-ranks=0 is invalid; expected an integer >= 1"),
    ({"--expert-ranks": "3"}, r"--expert-ranks=3 does not divide the model's 8 experts; valid: \[1, 2, 4, 8\]"),
    ({"--attention-ranks": "4", "--expert-ranks": "8", "--microbatches": "1"}, None),  # valid: M | N
    ({"--attention-ranks": "3", "--expert-ranks": "2"}, "--attention-ranks=3 and --expert-ranks=2: Asym-EA"),
    ({"--seq-length": "129"}, r"--seq-length=129 exceeds the model's max_position_embeddings=128; valid: 1..128"),
    ({"--seq-length": "0"}, "--seq-length=0 is invalid"),
    ({"--micro-batch-size": "0"}, "--micro-batch-size=0 is invalid"),
    ({"--device": "tpu"}, r"--device='tpu' is invalid; valid: \['cpu', 'cuda'\]"),
    ({"--device": "cuda"}, "--device=cuda, but no CUDA device is available"),
    ({"--device-type": " "}, "--device-type=' ' is invalid; expected a non-empty name"),
    ({"--role": "gate"}, r"--role='gate' is invalid; valid: \['attention', 'expert', 'both'\]"),
    ({"--dtype": "fp8"}, r"--dtype='fp8' is invalid; valid: \['fp32', 'bf16', 'fp16'\]"),
    ({"--dtype": "fp16"}, "--dtype=fp16 needs --device cuda"),
    ({"--repeats": "0"}, "--repeats=0 is invalid; expected an integer >= 1"),
    ({"--warmup": "-1"}, "--warmup=-1 is invalid; expected an integer >= 0"),
    ({"--memory-gb": "0"}, "--memory-gb=0.0 is invalid; expected a positive number of GB"),
    ({"--memory-gb": "nan"}, "--memory-gb=nan is invalid"),
    ({"--model-config": "no_such_model"}, "unknown model config 'no_such_model'; available: "),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU flag checks (the machine has a GPU)")
@pytest.mark.parametrize("overrides, message", BAD_FLAGS)
def test_bad_flags_fail_before_any_work(tmp_path, capsys, overrides, message):
    tool = load_tool()
    out = tmp_path / "profile.json"
    args = tool.build_parser().parse_args(tiny_flags(out, **overrides))
    if message is None:
        tool.request_from_args(args)  # the valid neighbour of a bad case
        return
    with pytest.raises(SystemExit) as exit_info:
        tool.main(tiny_flags(out, **overrides))
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err), message
    assert not out.exists()


def test_bad_models_and_output_files(tmp_path, capsys):
    tool = load_tool()
    out = tmp_path / "profile.json"
    cases = [
        ({"--model-config": write_model(tmp_path, "dense", num_experts=None, moe_ffn_hidden_size=None)},
         "describes a dense model"),
        ({"--model-config": write_model(tmp_path, "half", moe_layer_freq=2)},
         "has 1 MoE layers of 2 .*the profile prices every layer as MoE"),
        ({"--model-config": write_model(tmp_path, "shared", moe_shared_expert_intermediate_size=64, add_bias_linear=False)},
         "has a shared expert .*would price a shared expert as free"),
        ({"--model-config": write_model(tmp_path, "bad", hidden_size=0)}, "hidden_size=0 is invalid"),
        ({"--out": str(tmp_path / "missing" / "p.json")}, "the folder .*missing does not exist"),
    ]
    (tmp_path / "other.json").write_text(json.dumps({"format": "something-else"}))
    cases.append(({"--out": str(tmp_path / "other.json")}, "is not a zebra profile"))
    (tmp_path / "broken.json").write_text("{")
    cases.append(({"--out": str(tmp_path / "broken.json")}, "is not a readable JSON profile"))
    for overrides, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            tool.main(tiny_flags(out, **overrides))
        assert exit_info.value.code == 2
        assert re.search(message, capsys.readouterr().err), message
    assert not out.exists()


# ------------------------------------------------------------------------------------------
# The attention block is the layer minus its experts
# ------------------------------------------------------------------------------------------


MIXTRAL_LIKE = dict(
    num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, group_query_attention=True,
    num_query_groups=2, seq_length=16, max_position_embeddings=64, position_embedding_type="rope",
    normalization="RMSNorm", swiglu=True, add_bias_linear=False, num_experts=4, moe_router_topk=2,
    moe_ffn_hidden_size=48, vocab_size=100,
)


@pytest.mark.parametrize("model", ["tiny", "mixtral_like"])
def test_attention_block_plus_experts_is_megatrons_layer(model):
    """Block.dispatch -> the layer's own experts -> block.combine equals TransformerLayer.forward."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_patches.compat import mcore
    from megatron_patches.zebra.profiler import AttentionBlock, megatron_session, transformer_config

    cfg = load_model_config("tiny") if model == "tiny" else model_config_from_dict(MIXTRAL_LIKE)
    request = ProfileRequest(cfg, 2, 2, 2, 16, 3, "cpu", "cpu")
    with megatron_session("cpu", seed=7):
        config = transformer_config(request)
        _, spec = mcore.layer_specs("gpt", config, use_te=False)
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        layer = TransformerLayer(config, spec.submodules, layer_number=1, pg_collection=pgs).eval()
        block = AttentionBlock(config, spec, pgs).eval()
        own = {k: v for k, v in layer.state_dict().items() if not k.startswith("mlp.") or k.startswith("mlp.router.")}
        missing, unexpected = block.load_state_dict({k.replace("mlp.router.", "router."): v for k, v in own.items()},
                                                    strict=False)
        assert not unexpected and not [k for k in missing if "_extra_state" not in k]
        assert sum(p.numel() for p in block.parameters()) == sum(
            p.numel() for n, p in layer.named_parameters() if not n.startswith("mlp.experts."))

        S, B, H = 16, 3, cfg.hidden_size
        torch.manual_seed(0)
        x = torch.randn(S, B, H)
        mask = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]
        rope = None
        if cfg.position_embedding_type == "rope":
            rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0, rotary_base=cfg.rotary_base,
                                   use_cpu_initialization=True)(S)

        x_layer = x.clone().requires_grad_(True)
        reference, _ = layer(x_layer, attention_mask=mask, rotary_pos_emb=rope)
        reference.sum().backward()

        x_block = x.clone().requires_grad_(True)
        residual, tokens, probs = block.dispatch(x_block, mask, rope)
        per_expert = block.dispatcher.routing_map.sum(dim=0)
        expert_out, _ = layer.mlp.experts(tokens, per_expert, probs)
        output = block.combine(residual, expert_out)
        output.sum().backward()

    assert tokens.shape == (S * B * cfg.moe_router_topk, H)
    torch.testing.assert_close(output, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x_block.grad, x_layer.grad, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------
# End to end: two device types into one file, load, Asym-EA auto
# ------------------------------------------------------------------------------------------


def run_tool(*flags):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(TOOL), *flags], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)


def test_two_device_types_merge_load_and_drive_asym_ea(tmp_path, capsys):
    out = tmp_path / "zebra_profile.json"
    # Attention-type device: the tool as a user runs it.
    done = run_tool(*tiny_flags(out, **{"--device-type": "cpu-a", "--role": "attention", "--memory-gb": "0.2"}))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[profile_moe]   attention round 3/3" in done.stdout and "merged into" in done.stdout
    first = json.loads(out.read_text())

    # Expert-type device, in-process, with a memory budget too small for its 2 x 4 experts.
    tool = load_tool()
    assert tool.main(tiny_flags(out, **{"--device-type": "cpu-b", "--role": "expert", "--memory-gb": "0.003"})) == 0
    assert "expert round 3/3" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert sorted(data["devices"]) == ["cpu-a", "cpu-b"]
    assert data["devices"]["cpu-a"] == first["devices"]["cpu-a"]  # merging kept the first entry
    assert data["shape"] == {"num_layers": 2, "num_experts": 8, "attention_ranks": 2, "expert_ranks": 2}
    assert data["workload"]["seq_length"] == 32 and data["workload"]["micro_batch_size"] == 2

    cfg = load_model_config("tiny")
    a, b = data["details"]["cpu-a"], data["details"]["cpu-b"]
    entry_a, entry_b = data["devices"]["cpu-a"], data["devices"]["cpu-b"]
    # Token counts of one micro-batch: T = B*S = 64 per attention rank; an expert gets
    # M*T*k/n = 2*64*2/8 = 32; an expert rank holds n/N = 4 experts.
    assert a["tokens_per_attention_rank"] == 64 and a["tokens_per_expert"] == 32 and a["experts_per_expert_rank"] == 4
    # Parameter counts of the built modules against the exact Megatron count.
    counts = count_parameters(cfg)
    assert a["expert_parameters"] == b["expert_parameters"] == expert_parameter_count(cfg)
    norms_per_layer = 2 * 2 * cfg.hidden_size  # two LayerNorms (weight + bias)
    assert a["attention_block_parameters"] == (counts["attention"] + counts["router"]) // 2 + norms_per_layer
    # The stored times are the medians; T_E is n/N times one expert's.
    assert entry_a["t_attention_s"] == pytest.approx(a["attention"]["median_s"])
    assert entry_b["t_experts_s"] == pytest.approx(4 * b["expert"]["median_s"])
    assert entry_b["t_attention_s"] is None and entry_b["expert_slots_as_attention"] is None
    assert entry_a["expert_slots_as_expert"] is None
    for part in (a["attention"], a["expert"], b["expert"]):
        assert len(part["forward_s"]) == 3 and min(part["forward_s"] + part["backward_s"]) > 0
    # An expert's saved activations hold at least its input (32 x 64) and fc1's output and the
    # activation (32 x 128 each), fp32; the attention block at least its input (64 x 64 fp32).
    assert b["expert"]["saved_bytes"] >= 4 * 32 * (64 + 2 * 128)
    assert a["attention"]["saved_bytes"] >= 4 * 64 * 64
    # Slots from the stored figures: exact integer arithmetic (CPU: no transient workspace).
    per_param = bytes_per_parameter("fp32")
    slot = a["expert_parameters"] * per_param + 4 * a["expert"]["saved_bytes"]
    assert a["memory"]["expert_slot_bytes"] == slot
    resident = ((counts["total"] - counts["experts"]) * per_param + 2 * 4 * a["attention"]["saved_bytes"]
                + a["head"]["saved_bytes"])
    assert a["memory"]["attention_role_resident_bytes"] == resident
    assert entry_a["expert_slots_as_attention"] == (200_000_000 - resident) // slot > 8
    assert entry_b["expert_slots_as_expert"] == 3_000_000 // b["memory"]["expert_slot_bytes"] < 8

    shape = ZebraShape(2, 8, 2, 2)
    profile = load_zebra_profile(out, attention_device="cpu-a", expert_device="cpu-b")
    assert profile.t_attn_A == entry_a["t_attention_s"] and profile.t_exp_E == entry_b["t_experts_s"]
    assert profile.t_exp_A == entry_a["t_experts_s"]
    assert profile.n_min == max(0, 2 * 4 - entry_b["expert_slots_as_expert"])
    assert profile.n_max == entry_a["expert_slots_as_attention"]
    assert profile.n_min > 0
    plan = resolve_asym_ea("auto", shape, profile)
    # n1 = n2 = 1 (M = N): the plan moves at least the n_min experts that do not fit, at most 4 per layer.
    assert plan.n1 == plan.n2 == 1
    assert len(plan.offload_chunks_L) == 2 and all(0 <= c <= 4 for c in plan.offload_chunks_L)
    assert sum(plan.offload_chunks_L) >= profile.n_min
    with pytest.raises(ValueError, match="--zebra-asym-ea off is impossible"):
        resolve_asym_ea("off", shape, profile)
    with pytest.raises(ValueError, match="'cpu-b' was profiled only as an expert GPU"):
        load_zebra_profile(out, attention_device="cpu-b", expert_device="cpu-b")
    with pytest.raises(ValueError, match="'cpu-a' was profiled only as an attention GPU"):
        load_zebra_profile(out, attention_device="cpu-a", expert_device="cpu-a")

    # A file of another shape or another workload is refused before anything is built.
    for overrides, message in (({"--expert-ranks": "4"}, "holds a profile for shape"),
                               ({"--seq-length": "16"}, "another workload (differs in ['seq_length'])")):
        with pytest.raises(SystemExit):
            tool.main(tiny_flags(out, **{"--device-type": "cpu-c", **overrides}))
        assert message in capsys.readouterr().err
    assert json.loads(out.read_text()) == data


# ------------------------------------------------------------------------------------------
# The profile file: role-only entries, workload and details
# ------------------------------------------------------------------------------------------


def test_profile_file_roles_workload_and_details(tmp_path):
    from megatron_patches.placement.zebra import DeviceProfile, save_device_profile

    with pytest.raises(ValueError, match=r"DeviceProfile\[x\] has neither attention-role .* profiled for no role"):
        DeviceProfile("x", None, 1.0, None, None)
    with pytest.raises(ValueError, match=r"t_attention_s=1.0 and expert_slots_as_attention=None must both be given"):
        DeviceProfile("x", 1.0, 1.0, None, 3)
    path = tmp_path / "p.json"
    shape = ZebraShape(2, 4, 2, 2)
    save_device_profile(path, shape, DeviceProfile("a", 1.0, 1.0, 2, None), workload={"seq_length": 4},
                        details={"note": 1})
    save_device_profile(path, shape, DeviceProfile("b", None, 2.0, None, 3), workload={"seq_length": 4})
    data = json.loads(path.read_text())
    assert data["workload"] == {"seq_length": 4} and data["details"] == {"a": {"note": 1}}
    for workload in ({"seq_length": 8}, None):
        with pytest.raises(ValueError, match=r"was profiled under workload \{'seq_length': 4\}"):
            save_device_profile(path, shape, DeviceProfile("c", 1.0, 1.0, 2, 2), workload=workload)
    # Re-profiling a type replaces its entry and drops its old details.
    save_device_profile(path, shape, DeviceProfile("a", 0.5, 1.0, 2, None), workload={"seq_length": 4})
    data = json.loads(path.read_text())
    assert "details" not in data and data["devices"]["a"]["t_attention_s"] == 0.5
    profile = load_zebra_profile(path, "a", "b")
    assert (profile.t_attn_A, profile.t_exp_E, profile.t_exp_A, profile.n_min, profile.n_max) == (0.5, 2.0, 1.0, 1, 2)
