"""Context parallelism of the hybrid decoder (Kimi Linear and Kimi K3): each rank of a group holds consecutive
tokens of the same sequences (rank r the r-th of `size` equal slices) and the layers exchange what crosses the cut:

- KDA: the ranks' affine state maps, composed (`kimi_hf.ops.kda_context`: one all-gather of [B, H, K, V + K]);
- KDA's short convolutions: the previous rank's last W - 1 projected inputs (an all-gather of [B, W - 1, 3D]);
- MLA: the compressed latent of every token (kv_lora_rank + rope values a token: 576 in K3), gathered, so each rank
  attends its queries over the whole sequence with a causal, per-document mask in global positions;
- the depth attention, norms, MoE and the loss are per token: nothing to exchange.

Packed documents (position_ids restarting at 0) may cross the cut: the positions say whether a rank's first document
continues the previous rank's. What is refused (ValueError, before any layer runs): a padding attention_mask (pack
instead), a cache (generation), an attention implementation other than sdpa / eager, slices shorter than the short
convolution's context. See docs/parallelism.md ("Context parallelism").

Part of the flat, Hub-copyable model folder: torch and torch.distributed only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...ops.kda_context import all_gather_sequence


CP_ATTENTION = ("sdpa", "eager")  # with QK-Clip's recording wrappers of them (names ending so)


@dataclass
class ContextParallelism:
    """The group whose ranks split each sequence (rank order = token order); set on the decoder by
    `kimi_hf.distributed.context.enable_context_parallel`."""

    group: object

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)


@dataclass
class SequenceShard:
    """This rank's slice of the sequences, computed once per forward (`shard_for_forward`).

    pos_in_doc [B, T]: each token's position in its document (global: it counts the earlier ranks' tokens);
    continues [R]: whether row r's first document continues the previous rank's (R = B);
    attention_mask [B, 1, T, size * T] bool: MLA's causal, per-document mask of this rank's queries.
    """

    cp: ContextParallelism
    pos_in_doc: torch.Tensor
    continues: torch.Tensor
    attention_mask: torch.Tensor

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x concatenated along `dim` in rank order (differentiable): [.., T, ..] -> [.., size T, ..]."""
        return all_gather_sequence(x, self.cp.group).movedim(0, dim).flatten(dim, dim + 1)

    def left_context(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """The previous rank's last `width` tokens of x [B, T, C] -> [B, width, C]. Rank 0 gets the last rank's:
        its first tokens start a document (pos_in_doc 0, 1, ..), so the convolution masks them out; reading them
        keeps the all-gather's backward (an all-reduce) on every rank, as collectives must be."""
        return all_gather_sequence(x[:, -width:], self.cp.group)[self.cp.rank - 1]


def check_attention(config, who: str = "context parallelism") -> None:
    """ValueError unless the attention implementation is one context parallelism runs (MLA gathers the latent and
    attends with an explicit mask)."""
    impl = config._attn_implementation or "sdpa"
    if not impl.endswith(CP_ATTENTION):
        raise ValueError(f"{who}: attn_implementation {impl!r} is not supported; use one of {CP_ATTENTION}")


def check_slice_length(config, tokens: int, what: str = "this rank's slice") -> None:
    """ValueError if a rank's slice of `tokens` is shorter than KDA's short convolution reads from the rank before."""
    width = config.linear_conv_kernel_dim - 1
    if "linear_attention" in config.layer_types and tokens < width:
        raise ValueError(
            f"context parallelism: {what} holds {tokens} tokens, fewer than the short convolution's left context "
            f"({width}) that it reads from the previous rank; use fewer context-parallel ranks or longer sequences"
        )


def check_context_parallel(config, seq_len: int, attention_mask, past_key_values) -> None:
    """ValueError for what context parallelism does not run, before any layer does."""
    check_attention(config)
    if past_key_values is not None:  # (use_cache alone builds no cache here)
        raise ValueError("context parallelism runs whole sequences (training, scoring): no past_key_values / cache")
    if attention_mask is not None and not (attention_mask.ndim == 2 and bool(attention_mask.all())):
        raise ValueError(
            "context parallelism: a padding attention_mask is not supported; pack the sequences (position_ids "
            "restarting at 0) instead"
        )
    check_slice_length(config, seq_len)


def shard_for_forward(
    cp: ContextParallelism, batch_size: int, seq_len: int, position_ids: torch.Tensor | None, device
) -> tuple[torch.Tensor, SequenceShard]:
    """(position_ids [1 or B, T], the SequenceShard) for this rank's T tokens. position_ids: this rank's slice of
    the global positions (restarting at 0 for packed documents); None: one sequence a row, split evenly."""
    rank, size = cp.rank, cp.size
    if position_ids is None:
        position_ids = (torch.arange(seq_len, device=device) + rank * seq_len).unsqueeze(0)
    pos = position_ids.expand(batch_size, seq_len)
    # [size, B, T] (integers: no gradient); every rank holds the same B and T (context_parallel_batch's equal slices)
    everyone = all_gather_sequence(pos.contiguous(), cp.group)
    full = everyone.movedim(0, 1).flatten(1, 2)  # [B, size T] global positions
    # documents: a new one wherever the position does not follow the previous token's (as transformers' packing)
    starts = torch.ones_like(full, dtype=torch.bool)
    starts[:, 1:] = full[:, 1:] != full[:, :-1] + 1
    doc = starts.cumsum(1)
    t = torch.arange(size * seq_len, device=device).expand_as(full)
    in_doc = t - torch.where(starts, t, torch.zeros_like(t)).cummax(1).values  # position inside the document
    rows = torch.arange(seq_len, device=device) + rank * seq_len
    mine = doc[:, rows]  # [B, T]
    causal = torch.arange(size * seq_len, device=device)[None, :] <= rows[:, None]  # [T, size T]
    mask = (causal[None] & (doc[:, None, :] == mine[:, :, None]))[:, None]
    continues = (starts[:, rank * seq_len] == 0) if rank > 0 else torch.zeros(batch_size, dtype=torch.bool)
    shard = SequenceShard(cp, in_doc[:, rows], continues.to(device), mask)
    return position_ids, shard


__all__ = [
    "CP_ATTENTION",
    "ContextParallelism",
    "SequenceShard",
    "check_attention",
    "check_context_parallel",
    "check_slice_length",
    "shard_for_forward",
]
