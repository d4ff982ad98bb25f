"""The zebra schedule's tasks over Megatron-Core's own modules (DESIGN 4.7): attention, expert and
head forward/backward, dispatch and combine.

Per layer l and micro-batch j:

    A_F(l,j)  attention rank: [combine of layer l-1: un-permute the returned expert outputs, add
              the shared expert's output and the residual | embedding for l = 0] -> input norm
              -> self-attention -> residual add -> pre-MLP norm -> [shared expert] -> router ->
              permute the normed tokens by owner rank then expert
    D_F(l,j)  all-gather of the per-expert token counts over the ZP group, then two all-to-alls
              (tokens, probabilities) with uneven splits: attention ranks -> owners of the experts
    E_F(l,j)  owner: sort the received rows by local expert (Megatron's sort_chunks_by_idxs
              order), run each expert MLP (probabilities applied inside, as SequentialMLP does)
    C_F(l,j)  all-to-all of the expert outputs back to the attention ranks
    A_F(L,j)  head: combine of layer L-1, final norm, output layer, loss; A_B(L,j) right after
    C_B(l,j)  all-to-all of the gradient of the expert outputs (produced by A_B(l+1,j))
    E_B(l,j)  owner: expert backward -> gradients of the received tokens and probabilities
    D_B(l,j)  all-to-all of those gradients back to the attention ranks
    A_B(l,j)  one autograd backward of segment A_F(l,j) from the gradient of its residual output
              (from A_B(l+1,j)) together with the returned gradients of the dispatched tokens and
              probabilities: the expert-input gradient meets the gate-branch gradient inside the
              same backward, so no weight gets its backward twice.

The schedule's layers l are the MoE layers. A dense layer (--moe-layer-freq) runs whole, with
Megatron's TransformerLayer forward, on the attention ranks inside the attention task after it:
A_F(l,j) runs the dense layers between MoE layers l-1 and l after the combine (or the
embedding), the head those after the last MoE layer; their backward is in the same A_B.
Multi-token prediction (--mtp-num-layers): each depth's transformer layer is one more schedule
layer after the decoder's. Its A_F starts with Megatron's MTP steps (the previous output normed,
the rolled tokens embedded, both projected) and carries that previous output to the head, which
computes the main and MTP losses with GPTModel's own post-processing.

Every A_F segment starts from detached leaves (the previous segment's residual output, the
received expert outputs and, with shared experts, the shared expert's output), so a backward
stops at the attention output of each layer and resumes only in the next A_B task.

Under --recompute-granularity full, A_F segments and E_F tasks keep only their inputs and run
again in the backward.

Shared experts (--moe-shared-expert-intermediate-size) run on the attention ranks, in A_F(l,j)
on the normed tokens, as Megatron's MoELayer runs them before the router (DESIGN 4.7: by cost,
the attention role; it adds no all-to-all bytes and their output waits for the combine while
other micro-batches' tasks run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import permute, unpermute

from megatron_patches.comm.streams import CommStream
from megatron_patches.compat import activations, mcore
from megatron_patches.placement.zebra import Task
from megatron_patches.zebra.executor import COMM_STREAMS, Arrival, Collective
from megatron_patches.zebra.ownership import ZebraOwnership

__all__ = ["ZebraTasks", "masked_mean_loss", "permute_routed"]

# Routing probabilities travel in fp32: Megatron's router computes them in fp32 or the router
# dtype, which fp32 holds exactly; the receiver casts back to the dtype it needs.
_PROBS_DTYPE = torch.float32


def masked_mean_loss(losses_BS: torch.Tensor, batch: dict) -> torch.Tensor:
    """ep mode's GPT loss of one micro-batch: the mean token loss over batch["loss_mask"]."""
    mask_BS = batch["loss_mask"].float()
    return (losses_BS.float() * mask_BS).sum() / mask_BS.sum().clamp(min=1.0)


def permute_routed(tokens_TH: torch.Tensor, routing_TE: torch.Tensor, probs_TE: torch.Tensor,
                   rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's permute (moe_utils.permute, unfused, no padding) without reading device values:
    the routed (token, expert) pairs grouped by expert, tokens in order within an expert, as
    (tokens [rows, H], their probabilities [rows], their token indices [rows]). ``rows`` is the
    routed count, a host value when nothing is dropped (tokens x top-k); Megatron's masked_select
    finds it by copying it to the host, on a GPU a synchronisation per call. Here a stable sort of
    the expert-major map puts the routed pairs first, in masked_select's order."""
    unrouted_X = (~routing_TE.T.reshape(-1)).to(torch.int8)  # expert-major [E * T]: 0 = routed
    picked_X = torch.argsort(unrouted_X, stable=True)[:rows]
    sorted_indices_X = picked_X % routing_TE.shape[0]
    return tokens_TH.index_select(0, sorted_indices_X), probs_TE.T.reshape(-1).index_select(0, picked_X), sorted_indices_X


def _expert_major(counts_SK: np.ndarray) -> torch.Tensor:
    """Row index that turns received rows (source-major, then local expert) into expert-major
    order (local expert, then source), Megatron's sort_chunks_by_idxs order; from host counts."""
    offsets_SK = (np.cumsum(counts_SK.reshape(-1)) - counts_SK.reshape(-1)).reshape(counts_SK.shape)
    sources, experts = counts_SK.shape
    pieces = [np.arange(offsets_SK[s, k], offsets_SK[s, k] + counts_SK[s, k]) for k in range(experts) for s in range(sources)]
    return torch.from_numpy(np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64))


@dataclass
class _Exchange:
    """Split sizes of one (layer, micro-batch)'s four all-to-alls on this rank, from D_F's counts."""

    send_splits: list[int]
    """Rows this rank dispatches to each rank of its ZP group (as a token source)."""
    recv_splits: list[int]
    """Rows this rank receives from each rank of its ZP group (as an expert owner)."""
    counts_SK: np.ndarray
    """[group ranks, local experts] rows per (source rank, local expert), int64 (host values)."""


@dataclass
class _Segment:
    """What A_F(l, j) keeps for its backward A_B(l, j) and for the combine in A_F(l+1, j)."""

    inputs: list[torch.Tensor]
    """Leaves the segment started from: [] for layer 0; else [residual of layer l-1, received outputs]."""
    hidden_SBH: torch.Tensor
    """The residual stream after self-attention (the input of the MoE residual add)."""
    sent_XH: torch.Tensor
    """Dispatched tokens, sorted by owner rank, then expert, then token."""
    sent_probs_X: torch.Tensor
    """Their routing probabilities."""
    sorted_indices: torch.Tensor
    """permute's token index of every dispatched row (for unpermute)."""
    routing_map_TE: torch.Tensor
    """Routing map with columns in owner-major expert order (for unpermute)."""
    counts_E: torch.Tensor
    """Tokens per expert in expert-id order, int64 (what D_F gathers)."""
    shared_SBH: torch.Tensor | None = None
    """The shared expert's output (None: the model has no shared expert), added in the combine."""
    carried: tuple = ()
    """What the head takes from this segment: an MTP layer's input hidden states (the decoder's
    normed output, or the previous depth's normed output), for the main and MTP losses."""


class ZebraTasks:
    """This rank's tasks of one schedule run and what they pass each other (see the module
    docstring). ``groups``: the ZP group's dispatch and combine process groups; ``streams``: the
    executor's; ``loss_divisor``: attention ranks x micro-batches (each head loss is its share
    of the mean)."""

    def __init__(self, model, ownership: ZebraOwnership, groups: dict[str, object], streams: dict[str, CommStream],
                 loss_fn: Callable[[torch.Tensor, dict], torch.Tensor], loss_divisor: int) -> None:
        self.model = model
        self.own = ownership
        self.groups = groups
        self.streams = streams
        self.loss_fn = loss_fn
        self.loss_divisor = loss_divisor
        self.layers = ownership.layers
        """The MoE layers (the schedule's layers)."""
        self.num_layers = len(self.layers)
        decoder = list(model.decoder.layers)
        positions = [next((i for i, d in enumerate(decoder) if d is layer), len(decoder)) for layer in self.layers]
        self.decoder_moe_layers = sum(p < len(decoder) for p in positions)
        """MoE layers of the decoder; the schedule's layers after them are the MTP layers' (one per depth)."""
        self.mtp_layers = list(model.mtp.layers) if getattr(model, "mtp", None) is not None else []
        """Megatron's MultiTokenPredictionLayer per depth (--mtp-num-layers), whose transformer
        layer is schedule layer decoder_moe_layers + depth."""
        bounds = [-1, *positions[:self.decoder_moe_layers], len(decoder)]
        self.dense_before = [decoder[bounds[m] + 1:bounds[m + 1]] for m in range(self.decoder_moe_layers + 1)] + [
            [] for _ in self.mtp_layers]
        """Per schedule layer l (and the head, l = L): the dense decoder layers after MoE layer l-1
        that A_F(l) runs (those after the decoder's last MoE layer: the first MTP layer's, or the head's)."""
        self.num_experts = model.config.num_moe_experts
        self.hidden = model.config.hidden_size
        self.role, self.group_rank, self.device = ownership.role, ownership.group_rank, ownership.device
        self.group_size = ownership.layout.attention_ranks + ownership.layout.expert_ranks
        cfg = model.config
        full = cfg.recompute_granularity == "full"
        self.recomputed_layers = {m for m, position in enumerate(positions)
                                  if cfg.recompute_method == "uniform" or position < cfg.recompute_num_layers} if full else set()
        """MoE layers whose attention segments (A_F, with the dense layers before them) and expert
        tasks (E_F) keep only their inputs and run again in the backward (--recompute-granularity
        full: uniform 1 = every layer, MTP's too; block N = the decoder's MoE layers among the first
        N, as Megatron's MTP skips block recompute)."""
        self.reset([])

    def reset(self, batches: list[dict]) -> None:
        """Start a schedule run over this attention rank's micro-batches (none on expert ranks)."""
        self.batches = [self._prepare(batch) for batch in batches]
        self.losses: list[torch.Tensor] = []
        self.kept: dict[int, dict[int, int]] = {}  # micro-batch -> the storages its forward keeps (activations.measure)
        self.bytes_sent = dict.fromkeys(COMM_STREAMS, 0)
        self.remote_rows = 0
        self._exchange: dict[tuple[int, int], _Exchange] = {}
        self._segments: dict[tuple[int, int], _Segment] = {}
        self._head_loss: dict[int, tuple[torch.Tensor, list[torch.Tensor], dict[int, list[torch.Tensor]]]] = {}
        self._received: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_hidden: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_shared: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_carried: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._mtp_ids = {(0, mb): (b["tokens"], b["position_ids"]) for mb, b in enumerate(self.batches)}
        """(depth, micro-batch) -> the token ids and positions MTP depth `depth` rolls and embeds."""
        self._grad_received: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_sent: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._expert_in: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._expert_out: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._grad_expert_out: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_expert_in: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _prepare(self, batch: dict) -> dict:
        prepared = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        if self.model.position_embedding_type == "rope" and not self.model.config.multi_latent_attention:
            prepared["rotary_pos_emb"] = self.model.rotary_pos_emb(prepared["tokens"].shape[1])
        else:  # none, learned absolute, or MLA's attention, which applies its own rotary embedding (as GPTModel passes it)
            prepared["rotary_pos_emb"] = None
        return prepared

    def ready(self, task: Task, done: set[str]) -> bool:
        """Inputs produced on this rank (its own compute tasks, all-to-alls) have completed; tasks
        of the other role are reached only through an all-to-all."""
        other = "expert:" if self.role == "attention" else "attention:"
        if task.role == "group" and (task.kind, task.phase) != ("D", "F") and f"D_F({task.layer},{task.microbatch})" not in done:
            return False  # its split sizes come from the counts that D_F(l, j) gathered
        return all(dep in done for dep in task.deps if not dep.startswith(other))

    # ------------------------------------------------------------------------------------------
    # Compute tasks
    # ------------------------------------------------------------------------------------------

    def compute(self, task: Task) -> None:
        if task.phase == "F":
            # what this micro-batch's forward tasks keep for their backward, summed over its tasks
            with activations.measure(self.kept.setdefault(task.microbatch, {})):
                self._compute_task(task)
        else:
            self._compute_task(task)

    def _compute_task(self, task: Task) -> None:
        key = (task.layer, task.microbatch)
        if task.kind == "A" and task.phase == "F":
            if task.layer == self.num_layers:
                self._head_forward(task.microbatch)
            else:
                self._attention_forward(*key)
        elif task.kind == "A":
            if task.layer == self.num_layers:
                self._head_backward(task.microbatch)
            else:
                self._attention_backward(*key)
        elif task.phase == "F":
            self._experts_forward(*key)
        else:
            self._experts_backward(*key)

    def _combine_leaves(self, layer: int, mb: int) -> list[torch.Tensor]:
        """The detached leaves a segment after layer ``layer`` starts from: [its residual stream,
        the returned expert outputs(, the shared expert's output)], so the backward of the
        caller's segment stops here."""
        segment = self._segments[(layer, mb)]
        leaves = [segment.hidden_SBH.detach().requires_grad_(), self._received.pop((layer, mb)).requires_grad_()]
        if segment.shared_SBH is not None:
            leaves.append(segment.shared_SBH.detach().requires_grad_())
        return leaves

    def _combine(self, layer: int, mb: int, residual_SBH: torch.Tensor, received_XH: torch.Tensor,
                 shared_SBH: torch.Tensor | None = None) -> torch.Tensor:
        """The output of layer ``layer``: un-permute the returned expert outputs, add the shared
        expert's output (MoELayer.postprocess) and the residual."""
        segment = self._segments[(layer, mb)]
        moe_SBH = unpermute(
            received_XH,
            segment.sorted_indices,
            restore_shape=(residual_SBH.shape[0] * residual_SBH.shape[1], self.hidden),
            routing_map=segment.routing_map_TE,
        ).view(residual_SBH.shape)
        if shared_SBH is not None:
            moe_SBH = moe_SBH + shared_SBH
        transformer_layer = self.layers[layer]
        return transformer_layer.mlp_bda(transformer_layer.training, transformer_layer.config.bias_dropout_fusion)(
            (moe_SBH, None), residual_SBH, transformer_layer.hidden_dropout
        )

    def _attention_forward(self, layer: int, mb: int) -> None:
        """A_F(layer, mb): [combine of layer-1 | embedding] -> attention -> router -> permute. Under
        full recompute everything after the embedding is one checkpointed segment whose inputs are
        the leaves (layer 0: the embedding's output)."""
        batch = self.batches[mb]
        if layer == 0:
            inputs: list[torch.Tensor] = []
            starts = [self.model.embedding(input_ids=batch["tokens"], position_ids=batch["position_ids"])]
        else:
            inputs = starts = self._combine_leaves(layer - 1, mb)
        tl = self.layers[layer]
        order_E = self.own.owner_order_LE[layer]
        routed: dict[str, torch.Tensor] = {}
        shared_experts = tl.mlp.shared_experts

        def segment(*start):
            hidden_SBH, carried = self._layer_input(layer, mb, batch, start)
            attention = tl.self_attention(
                tl.input_layernorm(hidden_SBH), attention_mask=batch["attention_mask"],
                rotary_pos_emb=batch["rotary_pos_emb"],
            )
            mid_SBH = tl.self_attn_bda(tl.training, tl.config.bias_dropout_fusion)(attention, hidden_SBH, tl.hidden_dropout)
            normed_SBH = tl.pre_mlp_layernorm(mid_SBH)
            shared = () if shared_experts is None else (shared_experts(normed_SBH),)  # before the router, as MoELayer
            probs_TE, routing_TE = tl.mlp.router(normed_SBH)
            routing_ord_TE = routing_TE[:, order_E]
            if self.model.config.moe_expert_capacity_factor is None:
                # dropless: every token goes to top-k experts (a host value, so no read of routing_TE)
                sent_XH, sent_probs_X, sorted_indices = permute_routed(
                    normed_SBH.view(-1, self.hidden), routing_ord_TE, probs_TE[:, order_E],
                    rows=routing_TE.shape[0] * self.model.config.moe_router_topk,
                )
            else:  # token dropping: the kept count is data-dependent; Megatron's permute reads it (masked_select)
                sent_XH, sent_probs_X, sorted_indices = permute(
                    normed_SBH.view(-1, self.hidden), routing_ord_TE, probs=probs_TE[:, order_E])
            routed.update(routing_TE=routing_TE, routing_ord_TE=routing_ord_TE, sorted_indices=sorted_indices)
            return mid_SBH, sent_XH, sent_probs_X, *shared, *carried

        outputs = mcore.checkpointed(segment, *starts) if layer in self.recomputed_layers else segment(*starts)
        mid_SBH, sent_XH, sent_probs_X, *rest = outputs
        shared = rest[:1] if shared_experts is not None else []
        self._segments[(layer, mb)] = _Segment(
            inputs=inputs, hidden_SBH=mid_SBH, sent_XH=sent_XH, sent_probs_X=sent_probs_X,
            sorted_indices=routed["sorted_indices"], routing_map_TE=routed["routing_ord_TE"],
            counts_E=routed["routing_TE"].sum(dim=0).to(torch.int64), shared_SBH=shared[0] if shared else None,
            carried=tuple(rest[len(shared):]),
        )

    def _layer_input(self, layer: int, mb: int, batch: dict, start) -> tuple[torch.Tensor, tuple]:
        """From a segment's start (the embedding, or the leaves of the previous layer's combine):
        the input of schedule layer ``layer``'s attention (the head, layer L: the hidden states its
        loss reads), and what the segment carries to the head. Decoder layers: the dense layers
        before it. MTP depth k (Megatron's MultiTokenPredictionBlock, as GPTModel runs it): depth 0
        starts from the decoder's normed output, depth k > 0 from depth k-1's normed output; each
        is carried to the head and goes through the MTP layer's embedding and projection."""
        hidden_SBH = start[0] if layer == 0 else self._combine(layer - 1, mb, *start)
        depth = layer - self.decoder_moe_layers
        if depth <= 0:
            hidden_SBH = self._dense(layer, batch, hidden_SBH)
        if depth < 0:
            return hidden_SBH, ()
        out_SBH = (self.model.decoder.final_layernorm(hidden_SBH) if depth == 0
                   else mcore.mtp_layer_output(self.mtp_layers[depth - 1], hidden_SBH))
        if layer == self.num_layers:
            return out_SBH, ()
        ids, positions = self._mtp_ids[(depth, mb)]
        hidden_SBH, ids, positions = mcore.mtp_layer_input(self.mtp_layers[depth], ids, positions,
                                                           self.model.embedding, out_SBH)
        self._mtp_ids[(depth + 1, mb)] = (ids, positions)
        return hidden_SBH, (out_SBH,)

    def _dense(self, layer: int, batch: dict, hidden_SBH: torch.Tensor) -> torch.Tensor:
        """The dense layers A_F(layer) runs before its own (Megatron's TransformerLayer forward, as ep's block)."""
        for dense in self.dense_before[layer]:
            hidden_SBH, _ = dense(hidden_SBH, attention_mask=batch["attention_mask"],
                                  rotary_pos_emb=batch["rotary_pos_emb"])
        return hidden_SBH

    def _head_forward(self, mb: int) -> None:
        """A_F(L, mb): the combine of the last layer, the final norm, the output layer and the loss;
        with MTP the decoder's and the earlier depths' normed outputs (carried leaves) too, through
        GPTModel's own post-processing (the MTP losses ride on the main output's backward)."""
        batch = self.batches[mb]
        inputs = self._combine_leaves(self.num_layers - 1, mb)
        hidden_SBH, _ = self._layer_input(self.num_layers, mb, batch, inputs)
        carried = {layer: [c.detach().requires_grad_() for c in self._segments[(layer, mb)].carried]
                   for layer in range(self.decoder_moe_layers, self.num_layers)}
        if self.mtp_layers:
            outputs = [leaf for leaves in carried.values() for leaf in leaves] + [hidden_SBH]
            losses_BS = mcore.gpt_mtp_losses(self.model, outputs, batch)
        else:
            weight = self.model.shared_embedding_or_output_weight() if self.model.share_embeddings_and_output_weights else None
            logits_SBV, _ = self.model.output_layer(hidden_SBH, weight=weight)
            losses_BS = self.model.compute_language_model_loss(batch["labels"], logits_SBV)
        loss = self.loss_fn(losses_BS, batch)
        self.losses.append(loss.detach())
        self._head_loss[mb] = (loss, inputs, carried)

    def _head_backward(self, mb: int) -> None:
        loss, inputs, carried = self._head_loss.pop(mb)
        scaled = loss / self.loss_divisor
        scaler = self.own.precision.grad_scaler
        if scaler is not None:
            scaled = scaled * scaler.scale.to(scaled.device)
        scaled.backward()
        self._store_input_grads(self.num_layers - 1, mb, inputs)
        for layer, leaves in carried.items():  # to A_B(layer), with its segment's own outputs
            self._grad_carried[(layer, mb)] = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                                               for leaf in leaves]

    def _store_input_grads(self, layer: int, mb: int, inputs: list[torch.Tensor]) -> None:
        """Gradients of a segment's leaves: the residual's (and the shared expert output's) go to
        A_B(layer), the received outputs' to C_B(layer)."""
        residual, received, *shared = inputs
        stores = [(self._grad_hidden, residual), (self._grad_received, received)]
        stores += [(self._grad_shared, leaf) for leaf in shared]
        for store, leaf in stores:
            store[(layer, mb)] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)

    def _attention_backward(self, layer: int, mb: int) -> None:
        segment = self._segments.pop((layer, mb))
        grad_sent_XH, grad_sent_probs_X = self._grad_sent.pop((layer, mb))
        outputs = [segment.hidden_SBH, segment.sent_XH, segment.sent_probs_X]
        grads = [self._grad_hidden.pop((layer, mb)), grad_sent_XH, grad_sent_probs_X.to(segment.sent_probs_X.dtype)]
        if segment.shared_SBH is not None:
            outputs.append(segment.shared_SBH)
            grads.append(self._grad_shared.pop((layer, mb)))
        if segment.carried:
            outputs += segment.carried
            grads += self._grad_carried.pop((layer, mb))
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if segment.inputs:
            self._store_input_grads(layer - 1, mb, segment.inputs)

    def _experts_forward(self, layer: int, mb: int) -> None:
        tokens_XH, probs_X = self._expert_in.pop((layer, mb))
        tokens_XH.requires_grad_()
        probs_X.requires_grad_()
        mine = self.own.my_experts_L[layer]
        if not mine:
            self._expert_out[(layer, mb)] = (tokens_XH, probs_X, tokens_XH.new_zeros((0, self.hidden)))
            return
        counts_SK = self._exchange[(layer, mb)].counts_SK
        index = _expert_major(counts_SK).to(tokens_XH.device)
        per_expert = counts_SK.sum(axis=0).tolist()
        experts = self.layers[layer].mlp.experts.local_experts
        apply_probs_on_input = self.model.config.moe_apply_probs_on_input

        def compute(tokens_XH: torch.Tensor, probs_X: torch.Tensor) -> torch.Tensor:
            sorted_XH, sorted_probs_X = tokens_XH[index], probs_X[index]
            if apply_probs_on_input:
                # SequentialMLP: scale the input instead, probabilities reset to 1.
                sorted_XH = (sorted_probs_X.unsqueeze(-1) * sorted_XH).to(tokens_XH.dtype)
                sorted_probs_X = torch.ones_like(sorted_probs_X)
            outputs = [
                experts[e](chunk_XH, chunk_probs_X)[0]
                for e, chunk_XH, chunk_probs_X in zip(mine, sorted_XH.split(per_expert), sorted_probs_X.split(per_expert))
            ]
            return torch.cat(outputs)[torch.argsort(index)]

        # full recompute: only the received tokens and probabilities are kept for the backward
        output_XH = mcore.checkpointed(compute, tokens_XH, probs_X) if layer in self.recomputed_layers else compute(
            tokens_XH, probs_X)
        self._expert_out[(layer, mb)] = (tokens_XH, probs_X, output_XH)

    def _experts_backward(self, layer: int, mb: int) -> None:
        tokens_XH, probs_X, output_XH = self._expert_out.pop((layer, mb))
        grad_output_XH = self._grad_expert_out.pop((layer, mb))
        if output_XH.requires_grad and output_XH.numel():
            output_XH.backward(grad_output_XH)
        grad_tokens = tokens_XH.grad if tokens_XH.grad is not None else torch.zeros_like(tokens_XH)
        grad_probs = probs_X.grad if probs_X.grad is not None else torch.zeros_like(probs_X)
        self._grad_expert_in[(layer, mb)] = (grad_tokens, grad_probs)

    # ------------------------------------------------------------------------------------------
    # All-to-all tasks
    # ------------------------------------------------------------------------------------------

    def _a2a(self, stream: str, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]):
        received = send.new_empty((sum(recv_splits), *send.shape[1:]))
        row_bytes = send.element_size() * int(np.prod(send.shape[1:]))  # 1 for a vector
        self.bytes_sent[stream] += (sum(send_splits) - send_splits[self.group_rank]) * row_bytes
        with self.streams[stream].launch(send, received):
            work = dist.all_to_all_single(received, send.contiguous(), recv_splits, send_splits,
                                          group=self.groups[stream], async_op=True)
        return received, work

    def launch(self, task: Task) -> Collective:
        key = (task.layer, task.microbatch)
        stream = "dispatch" if task.kind == "D" else "combine"
        empty_XH = torch.zeros((0, self.hidden), dtype=self.own.dtype, device=self.device)
        if (task.kind, task.phase) == ("D", "F"):
            return self._launch_dispatch(task, empty_XH)
        exchange = self._exchange[key]
        if (task.kind, task.phase) == ("C", "F"):
            send = self._expert_out[key][2].detach() if key in self._expert_out else empty_XH
            received, work = self._a2a(stream, send, exchange.recv_splits, exchange.send_splits)

            def finish():
                if self.role == "attention":
                    self._received[key] = received

            return Collective(task, [work], [], finish)
        if (task.kind, task.phase) == ("C", "B"):
            send = self._grad_received.pop(key) if self.role == "attention" else empty_XH
            received, work = self._a2a(stream, send, exchange.send_splits, exchange.recv_splits)

            def finish():
                if key in self._expert_out:
                    self._grad_expert_out[key] = received

            return Collective(task, [work], [], finish)
        # D_B: gradients of the expert inputs back to the token sources.
        if key in self._grad_expert_in:
            grad_tokens, grad_probs = self._grad_expert_in.pop(key)
        else:
            grad_tokens, grad_probs = empty_XH, torch.zeros(0, dtype=torch.float32, device=self.device)
        tokens, work_tokens = self._a2a(stream, grad_tokens, exchange.recv_splits, exchange.send_splits)
        probs, work_probs = self._a2a(stream, grad_probs.to(_PROBS_DTYPE), exchange.recv_splits,
                                      exchange.send_splits)

        def finish():
            if self.role == "attention":
                self._grad_sent[key] = (tokens, probs)

        return Collective(task, [work_tokens, work_probs], [], finish)

    def _launch_dispatch(self, task: Task, empty_XH: torch.Tensor) -> Collective:
        """D_F: gather the per-expert counts of every rank of the ZP group, copy them to the host
        (asynchronously, on the dispatch stream), then send the tokens and probabilities with the
        split sizes the counts give. The all-to-all needs its split sizes on the host, so this is
        the one read of device values per (layer, micro-batch); it waits for the copy's event in
        the poll loop, never for the compute stream."""
        key = (task.layer, task.microbatch)
        segment = self._segments.get(key) if self.role == "attention" else None
        counts_E = segment.counts_E if segment is not None else torch.zeros(self.num_experts, dtype=torch.int64)
        counts_E = counts_E.to(self.device)
        gathered_GE = counts_E.new_empty(self.group_size * self.num_experts)  # flat: gloo's layout
        with self.streams["dispatch"].launch(counts_E, gathered_GE):
            work = dist.all_gather_into_tensor(gathered_GE, counts_E, group=self.groups["dispatch"], async_op=True)
        result: dict[str, torch.Tensor] = {}

        def copy_counts() -> list:
            host_GE, arrived = self.streams["dispatch"].to_host(gathered_GE)
            result["counts_GE"] = host_GE.view(self.group_size, self.num_experts)
            return [Arrival(arrived)]

        def send_tokens() -> list:
            self._exchange[key] = self._split_sizes(task.layer, result["counts_GE"])
            tokens = segment.sent_XH.detach() if segment is not None else empty_XH
            probs = (segment.sent_probs_X.detach() if segment is not None
                     else torch.zeros(0, dtype=_PROBS_DTYPE, device=self.device)).to(_PROBS_DTYPE)
            exchange = self._exchange[key]
            result["tokens"], work_tokens = self._a2a("dispatch", tokens, exchange.send_splits, exchange.recv_splits)
            result["probs"], work_probs = self._a2a("dispatch", probs, exchange.send_splits, exchange.recv_splits)
            return [work_tokens, work_probs]

        def finish():
            if self.role == "expert" or self.own.has_experts_L[task.layer]:
                self._expert_in[key] = (result["tokens"], result["probs"])

        return Collective(task, [work], [copy_counts, send_tokens], finish)

    def _split_sizes(self, layer: int, counts_GE: torch.Tensor) -> _Exchange:
        """The all-to-all split sizes of one (layer, micro-batch) from the host copy of the ZP
        group's counts [group ranks, experts]."""
        counts_GE_np = counts_GE.numpy()
        owners_E = self.own.owners_LE[layer]
        send_splits = [int(counts_GE_np[self.group_rank, owners_E == d].sum()) for d in range(self.group_size)]
        counts_SK = counts_GE_np[:, self.own.my_experts_L[layer]]
        self.remote_rows += sum(send_splits) - send_splits[self.group_rank]
        return _Exchange(send_splits, counts_SK.sum(axis=1).tolist(), counts_SK)
