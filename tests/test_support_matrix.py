"""The support matrix of docs/modes.md (fssdp, replicate and zebra x Megatron feature), checked against the tests.

Each cell is one of:
- tested: a test that trains the mode with the feature against ep (named as `file::function`,
  with the parametrization where there is one); the test must exist;
- refused: the flags are refused before any work starts, with a message that contains the given
  words; validation runs here on those flags, so a refusal that disappears or changes fails;
- not tested: accepted but never trained in a test (said plainly rather than left out);
- n/a: the feature does not exist in that mode (accepted, nothing to do).
A zebra cell adds zebra's own flags (2 attention + 2 expert ranks per ZP group, 2 micro-batches,
EP 1 for the row's EP) to the row's, refused cells too.

The block between the markers in docs/modes.md must equal `render()`; after changing `MATRIX`,
write it with `python tests/test_support_matrix.py --write docs/modes.md`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_patches.config.flags import ArgumentError
from megatron_patches.training.arguments import parse_args
from megatron_patches.training.validation import validate_args
from support.training import TINY_JOB

TESTS = Path(__file__).resolve().parent
MODES_DOC = TESTS.parent / "docs" / "modes.md"
BEGIN, END = "<!-- support-matrix: begin -->", "<!-- support-matrix: end -->"
MODES = ("fssdp", "replicate", "zebra")


@dataclass(frozen=True)
class Cell:
    status: str
    """tested, refused, not tested, or n/a (the feature does not exist in the mode)."""
    where: str = ""
    """tested: file::function[param]; refused: words of the refusal; not tested: why it matters."""
    flags: tuple[str, ...] = ()
    """What this mode needs besides the row's flags."""


@dataclass(frozen=True)
class Row:
    feature: str
    flags: tuple[str, ...]
    """What a user adds to the tiny model's flags (besides --moe-parallel-mode)."""
    world: int
    cells: dict


ZEBRA = ("--expert-model-parallel-size", "1", "--zebra-attention-ranks", "2", "--zebra-expert-ranks", "2",
         "--zebra-microbatches", "2")


def by_test(where: str, *flags: str) -> Cell:
    return Cell("tested", where, flags)


def refusal(words: str) -> Cell:
    return Cell("refused", words)


def zebra(status: str, where: str) -> Cell:
    """A zebra cell: zebra's own flags besides the row's."""
    return Cell(status, where, ZEBRA)


WHOLE_MODEL = "zebra builds the whole model on every rank and splits it by role"
OWN_OPTIMIZER = "zebra has its own optimizer"


COMPOSITION = "training/test_composition.py::"
PRECISION = "training/test_precision_training.py::"
MODERN = "training/test_modern_moe_modes.py::"
CONFIGS = "training/test_model_configs_train.py::"
MATRIX = (
    Row("more ranks than one expert group (EDP 2)", ("--expert-model-parallel-size", "4"), 8, {
        "fssdp": by_test(COMPOSITION + "test_fssdp_two_expert_groups_reshard_and_resume_elsewhere"),
        "replicate": by_test(COMPOSITION + "test_replicate_two_expert_groups"),
        "zebra": zebra("tested", "zebra/test_zebra_engine.py::test_zebra_equals_megatron_reference[groups]")}),
    Row("TP 2 + sequence parallel, PP 2, EDP 2, distributed optimizer, together",
        ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
         "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--use-distributed-optimizer"), 8, {
        "fssdp": by_test(COMPOSITION + "test_tp_sp_pp_edp_and_distributed_optimizer_together[fssdp]",
                         "--fssdp-reshard-interval", "0", "--overlap-grad-reduce", "--overlap-param-gather"),
        "replicate": by_test(COMPOSITION + "test_tp_sp_pp_edp_and_distributed_optimizer_together[replicate]",
                             "--overlap-grad-reduce", "--overlap-param-gather"),
        "zebra": zebra("refused", WHOLE_MODEL)}),
    Row("TP 2 + sequence parallel", ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                     "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"), 4, {
        "fssdp": by_test(COMPOSITION + "test_one_composition_at_a_time[tp2_sp-fssdp]"),
        "replicate": by_test(COMPOSITION + "test_one_composition_at_a_time[tp2_sp-replicate]"),
        "zebra": zebra("refused", WHOLE_MODEL)}),
    Row("PP 2 (4 micro-batches)", ("--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"), 4, {
        "fssdp": by_test(COMPOSITION + "test_one_composition_at_a_time[pp2-fssdp]"),
        "replicate": by_test(COMPOSITION + "test_one_composition_at_a_time[pp2-replicate]"),
        "zebra": zebra("refused", WHOLE_MODEL)}),
    Row("virtual pipeline stages (PP 2 x VP 2)", ("--num-layers", "4", "--pipeline-model-parallel-size", "2",
                                                  "--num-layers-per-virtual-pipeline-stage", "1",
                                                  "--expert-model-parallel-size", "2", "--global-batch-size", "16"), 4, {
        "fssdp": by_test(COMPOSITION + "test_virtual_pipeline_stages[fssdp]"),
        "replicate": by_test(COMPOSITION + "test_virtual_pipeline_stages[replicate]"),
        "zebra": zebra("refused", WHOLE_MODEL)}),
    Row("distributed optimizer", ("--use-distributed-optimizer", "--expert-model-parallel-size", "4"), 4, {
        "fssdp": by_test(COMPOSITION + "test_one_composition_at_a_time[distopt-fssdp]"),
        "replicate": by_test(COMPOSITION + "test_one_composition_at_a_time[distopt-replicate]"),
        "zebra": zebra("refused", OWN_OPTIMIZER)}),
    Row("BERT", ("--model-family", "bert", "--expert-model-parallel-size", "2"), 2, {
        "fssdp": by_test(COMPOSITION + "test_bert[fssdp]"),
        "replicate": by_test(COMPOSITION + "test_bert[replicate]"),
        "zebra": zebra("refused", "zebra mode trains GPT models")}),
    Row("bf16", ("--bf16",), 4, {
        "fssdp": by_test(PRECISION + "test_bf16_in_every_mode_follows_ep_within_bf16_noise"),
        "replicate": by_test(PRECISION + "test_bf16_in_every_mode_follows_ep_within_bf16_noise"),
        "zebra": zebra("tested", PRECISION + "test_bf16_in_every_mode_follows_ep_within_bf16_noise")}),
    Row("fp16 with recompute and the distributed optimizer", ("--fp16", "--use-distributed-optimizer"), 4, {
        "fssdp": by_test(PRECISION + "test_half_precision_with_recompute_and_distributed_optimizer[fp16-fssdp]"),
        "replicate": by_test(PRECISION + "test_half_precision_with_recompute_and_distributed_optimizer[fp16-replicate]"),
        "zebra": zebra("refused", OWN_OPTIMIZER)}),
    Row("full activation recompute", ("--recompute-granularity", "full", "--recompute-method", "uniform",
                                      "--recompute-num-layers", "1"), 4, {
        "fssdp": by_test(PRECISION + "test_recompute_keeps_losses_and_loads[fssdp_full_remat]"),
        "replicate": by_test(PRECISION + "test_recompute_keeps_losses_and_loads[replicate_full]"),
        "zebra": zebra("tested", "zebra/test_zebra_engine.py::test_recompute_keeps_losses_and_lowers_activation_memory")}),
    Row("save at 8 ranks (2 expert groups), resume at 4 (1 group)", ("--expert-model-parallel-size", "4"), 8, {
        "fssdp": by_test(COMPOSITION + "test_fssdp_two_expert_groups_reshard_and_resume_elsewhere"),
        "replicate": by_test(COMPOSITION + "test_replicate_saved_in_two_groups_resumes_in_one_in_fssdp"),
        "zebra": zebra("tested", "zebra/test_zebra_training.py::test_checkpoints_resume_in_zebra_layouts_and_in_ep")}),
    Row("more ranks than experts (4 experts on 8 ranks: EP 4 x EDP 2)",
        ("--num-experts", "4", "--expert-model-parallel-size", "4"), 8, {
        "fssdp": by_test(COMPOSITION + "test_more_ranks_than_experts[fssdp]"),
        "replicate": by_test(COMPOSITION + "test_more_ranks_than_experts[replicate]"),
        "zebra": zebra("not tested", "8 ranks are 2 ZP groups of 2 + 2, each expert rank holding 2 of the 4 experts; trained only with 2 groups of 1 + 1")}),
    Row("checkpoints with the distributed optimizer", ("--use-distributed-optimizer", "--save", "ckpt",
                                                       "--save-interval", "5"), 4, {
        "fssdp": by_test(COMPOSITION + "test_fssdp_checkpoints_with_the_distributed_optimizer"),
        "replicate": by_test(COMPOSITION + "test_replicate_checkpoints_with_the_distributed_optimizer"),
        "zebra": zebra("refused", OWN_OPTIMIZER)}),
    Row("re-sharding with the distributed optimizer over several expert groups",
        ("--expert-model-parallel-size", "4", "--use-distributed-optimizer"), 8, {
        "fssdp": by_test(COMPOSITION + "test_fssdp_reshards_with_the_distributed_optimizer_over_two_expert_groups"),
        "replicate": Cell("n/a", "replicate never re-shards: its optimizer slices never move"),
        "zebra": zebra("refused", OWN_OPTIMIZER)}),
    Row("grouped GEMM (fp32 and bf16)", ("--moe-grouped-gemm", "--disable-bias-linear"), 4, {
        "fssdp": by_test(COMPOSITION + "test_grouped_gemm[fssdp]"),
        "replicate": by_test(COMPOSITION + "test_grouped_gemm[replicate]"),
        "zebra": zebra("refused", "zebra runs each expert's MLP module")}),
    Row("grouped GEMM with biases", ("--moe-grouped-gemm",), 4, {
        "fssdp": refusal("runs the experts without biases, as Megatron's GroupedMLP"),
        "replicate": refusal("runs the experts without biases, as Megatron's GroupedMLP"),
        "zebra": zebra("refused", "zebra runs each expert's MLP module")}),
    Row("overlapped gradient reduce and parameter gather",
        ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"), 4, {
        "fssdp": by_test(COMPOSITION + "test_tp_sp_pp_edp_and_distributed_optimizer_together[fssdp]"),
        "replicate": by_test(COMPOSITION + "test_tp_sp_pp_edp_and_distributed_optimizer_together[replicate]"),
        "zebra": zebra("refused", OWN_OPTIMIZER)}),
    Row("expert tensor parallelism", ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                      "--expert-tensor-parallel-size", "2", "--disable-bias-linear"), 4, {
        "fssdp": by_test(COMPOSITION + "test_expert_tensor_parallelism[fssdp]"),
        "replicate": by_test(COMPOSITION + "test_expert_tensor_parallelism[replicate]"),
        "zebra": zebra("refused", WHOLE_MODEL)}),
    Row("MoE-only recompute", ("--recompute-granularity", "selective", "--recompute-modules", "moe"), 4, {
        "fssdp": refusal("plans its collectives once per forward"),
        "replicate": refusal("plans its collectives once per forward"),
        "zebra": zebra("refused", "only the attention module's own recompute applies")}),
    Row("padding expert inputs to capacity", ("--moe-expert-capacity-factor", "1.0",
                                              "--moe-pad-expert-input-to-capacity"), 4, {
        "fssdp": refusal("padding is per expert rank"),
        "replicate": refusal("padding is per expert rank"),
        "zebra": zebra("tested", "zebra/test_zebra_training.py::test_token_dropping_drops_what_ep_drops[capacity_pad]")}),
    Row("shared experts", ("--moe-shared-expert-intermediate-size", "96", "--disable-bias-linear",
                           "--expert-model-parallel-size", "4"), 4, {
        "fssdp": by_test(MODERN + "test_shared_experts_train_as_in_ep[fssdp]"),
        "replicate": by_test(MODERN + "test_shared_experts_train_as_in_ep[replicate]"),
        "zebra": zebra("tested", MODERN + "test_zebra_runs_shared_experts_on_its_attention_ranks_as_ep_does")}),
    Row("multi-latent attention", ("--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "8",
                                   "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "16",
                                   "--position-embedding-type", "rope", "--expert-model-parallel-size", "4"), 4, {
        "fssdp": by_test(MODERN + "test_multi_latent_attention_trains_as_in_ep[fssdp]"),
        "replicate": by_test(MODERN + "test_multi_latent_attention_trains_as_in_ep[replicate]"),
        "zebra": zebra("tested", MODERN + "test_multi_latent_attention_trains_as_in_ep[zebra]")}),
    Row("multi-token prediction (EP 4, and PP 2 x EP 2)", ("--mtp-num-layers", "1", "--expert-model-parallel-size", "4"), 4, {
        "fssdp": by_test(MODERN + "test_multi_token_prediction_layers_are_placed_and_train_as_in_ep[fssdp]"),
        "replicate": by_test(MODERN + "test_multi_token_prediction_layers_are_placed_and_train_as_in_ep[replicate]"),
        "zebra": zebra("tested", MODERN + "test_zebra_runs_the_mtp_layer_in_its_schedule_as_ep_does")}),
    Row("aux-loss-free and group-limited routing (sigmoid scores, expert bias, 4 groups top-2, z-loss)",
        ("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-num-groups", "4",
         "--moe-router-group-topk", "2", "--moe-z-loss-coeff", "1e-3", "--expert-model-parallel-size", "4"), 4, {
        "fssdp": by_test(MODERN + "test_aux_loss_free_group_limited_routing_routes_and_trains_as_in_ep[fssdp]"),
        "replicate": by_test(MODERN + "test_aux_loss_free_group_limited_routing_routes_and_trains_as_in_ep[replicate]"),
        "zebra": zebra("tested", MODERN + "test_zebra_routes_with_the_expert_bias_as_ep_does_and_resumes_it")}),
    Row("dense layers (--moe-layer-freq: a dense first layer)", ("--moe-layer-freq", "[0,1]", "--expert-model-parallel-size",
                                                                   "4"), 4, {
        "fssdp": by_test(CONFIGS + "test_every_mode_trains_the_model_as_ep_does[deepseek_v2_lite_tiny]"),
        "replicate": by_test(CONFIGS + "test_every_mode_trains_the_model_as_ep_does[deepseek_v2_lite_tiny]"),
        "zebra": zebra("tested", CONFIGS + "test_zebra_trains_all_four_models")}),
)


def _cell_text(cell: Cell) -> str:
    if cell.status == "tested":
        return f"tested: `{cell.where}`" + (f" (with `{' '.join(cell.flags)}`)" if cell.flags else "")
    if cell.status == "refused":
        return f"refused: \"...{cell.where}...\""
    return f"{cell.status} ({cell.where})"


def render() -> str:
    lines = [BEGIN, "| feature | flags (on the tiny model) | " + " | ".join(MODES) + " |",
             "|---|---|" + "---|" * len(MODES)]
    for row in MATRIX:
        lines.append(f"| {row.feature} | `{' '.join(row.flags)}` ({row.world} ranks) | " + " | ".join(_cell_text(row.cells[m]) for m in MODES) + " |")
    lines.append(END)
    return "\n".join(lines)


def readme_block(text: str) -> str:
    match = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, flags=re.S)
    assert match, f"docs/modes.md has no {BEGIN} ... {END} block"
    return match.group(0)


def test_readme_shows_the_matrix():
    assert readme_block(MODES_DOC.read_text()) == render(), (
        "docs/modes.md's support matrix differs from tests/test_support_matrix.py: run "
        "python tests/test_support_matrix.py --write docs/modes.md")


CELLS = [(row, mode) for row in MATRIX for mode in MODES]


@pytest.fixture(scope="module")
def collected() -> set[str]:
    """The node ids pytest collects from the files the tested cells name (collection only)."""
    files = sorted({row.cells[m].where.partition("::")[0] for row in MATRIX for m in MODES if row.cells[m].status == "tested"})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *(str(TESTS / f) for f in files)], cwd=TESTS.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {line.strip().removeprefix("tests/") for line in proc.stdout.splitlines() if "::" in line}


@pytest.mark.parametrize("row, mode", [c for c in CELLS if c[0].cells[c[1]].status == "tested"],
                         ids=lambda value: getattr(value, "feature", value))
def test_every_tested_cell_names_a_collected_test(collected, row, mode):
    where = row.cells[mode].where
    assert where in collected or any(node.startswith(where + "[") for node in collected), (
        f"no collected test is {where}; collected: {sorted(collected)}")


@pytest.mark.parametrize("row, mode", [c for c in CELLS if c[0].cells[c[1]].status == "refused"],
                         ids=lambda value: getattr(value, "feature", value))
def test_every_refused_cell_is_refused_before_any_work(row, mode):
    args = parse_args([*TINY_JOB, "--moe-parallel-mode", mode, *row.flags, *row.cells[mode].flags])
    with pytest.raises(ArgumentError) as caught:
        validate_args(args, row.world)
    assert row.cells[mode].where in str(caught.value)


@pytest.mark.parametrize("row, mode", [c for c in CELLS if c[0].cells[c[1]].status != "refused"],
                         ids=lambda value: getattr(value, "feature", value))
def test_every_other_cell_is_accepted(row, mode):
    validate_args(parse_args([*TINY_JOB, "--moe-parallel-mode", mode, *row.flags, *row.cells[mode].flags]), row.world)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--write"] or len(sys.argv) != 3:
        sys.exit("usage: python tests/test_support_matrix.py --write docs/modes.md")
    target = Path(sys.argv[2])
    text = target.read_text()
    target.write_text(text.replace(readme_block(text), render()))
    print(f"wrote the support matrix into {target}")
