"""Forward steps and losses for Megatron's pipeline schedules, one per model family.

`forward_step(data_iterator, model)` returns (output, loss function), as
`megatron.core.pipeline_parallel` schedules expect; the loss function returns (loss, reported
values). `mean_loss_over_world` averages the reported losses of one iteration over data-parallel
ranks. Each model call is a measured forward (`compat.activations`): the bytes it keeps for the
backward are the run's activation memory.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state

from megatron_patches.compat import activations
from megatron_patches.data import datasets


def forward_step_for(args):
    """The forward step of --model-family."""
    if args.model_family == "gpt":
        return gpt_forward_step
    return partial(bert_forward_step, binary_head=args.bert_binary_head)


def _masked_mean(losses_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    return (losses_BS.float() * mask_BS).sum() / mask_BS.sum().clamp(min=1.0)


def gpt_loss(mask_BS, output_BS):
    loss = _masked_mean(output_BS, mask_BS)
    return loss, {"lm loss": loss.detach().clone()}  # clone: Megatron divides `loss` in place


def _on_model_device(batch: dict, model) -> dict:
    """The micro-batch's tensors on the model's device (the data loader yields them on the host)."""
    device = next(model.parameters()).device
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def gpt_forward_step(data_iterator, model):
    batch = _on_model_device(datasets.gpt_batch(next(data_iterator)), model)
    with activations.measure():
        # the loss mask also weighs the multi-token-prediction losses (GPTModel, --mtp-num-layers)
        output_BS = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                          loss_mask=batch["loss_mask"])
    return output_BS, partial(gpt_loss, batch["loss_mask"])


def bert_loss(mask_BS, is_random_B, output):
    lm_losses_BS, binary_logits_B2 = output
    lm = _masked_mean(lm_losses_BS, mask_BS)
    if binary_logits_B2 is None:
        return lm, {"lm loss": lm.detach().clone()}
    sop = F.cross_entropy(binary_logits_B2.view(-1, 2).float(), is_random_B.view(-1), ignore_index=-1)
    loss = lm + sop
    return loss, {"lm loss": loss.detach().clone()}  # clone: Megatron divides `loss` in place


def bert_forward_step(data_iterator, model, binary_head: bool):
    batch = _on_model_device(datasets.bert_batch(next(data_iterator)), model)
    with activations.measure():
        output = model(
            batch["tokens"], batch["padding_mask"], tokentype_ids=batch["types"] if binary_head else None, lm_labels=batch["labels"]
        )
    if not isinstance(output, tuple):
        output = (output, None)
    return output, partial(bert_loss, batch["loss_mask"], batch["is_random"])


def mean_loss_over_world(losses: list[dict]) -> float:
    """Mean micro-batch loss of the last pipeline stage, averaged over data-parallel ranks."""
    # one read of all micro-batches' losses (on a GPU, one synchronisation, not one per micro-batch)
    total = float(torch.stack([d["lm loss"].detach().double() for d in losses]).sum()) if losses else 0.0
    counts = torch.tensor([total, float(len(losses))], dtype=torch.float64)
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        counts.zero_()
    dist.all_reduce(counts)
    return float(counts[0] / counts[1]) if counts[1] > 0 else float("nan")
