"""``bi-triton-paged`` and ``bi-triton-mla``: paged attention computed one (token, head)
at a time over key chunks of a fixed size aligned to absolute positions, so a token's output
is the same whether it is decoded alone, in a batch, or verified among draft tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kernelbay.layers.torch_attention import TorchPagedAttention
from kernelbay.layers.torch_mla import TorchMLAAttention
from kernelbay.verdict import Verdict

from kernelbay_batch_invariant.checks import runs_on_cuda

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability
    from kernelbay.layers.attention import AttentionMetadata
    from kernelbay.requests import AttentionRequest

__all__ = ["BLOCK_N", "BatchInvariantMLAAttention", "BatchInvariantPagedAttention",
           "split_size"]

#: Keys per chunk of the online softmax (the fixed split size) for heads up to 128 wide;
#: wider heads (MLA's 576) use smaller chunks so a chunk's keys fit in registers. The size
#: is a function of the head dim alone.
BLOCK_N = 64


def split_size(head_dim: int) -> int:
    """Keys per chunk for a key width of ``head_dim``: 64 up to 128, then fewer (>= 16)."""
    width = 1 << max(0, (head_dim - 1).bit_length())
    return max(16, min(BLOCK_N, 8192 // width))


_MAX_HEAD_DIM = 1024


class BatchInvariantPagedAttention(TorchPagedAttention):
    """MHA/GQA/MQA over the core's paged K/V layout, batch invariant (Triton)."""

    name: ClassVar[str] = "bi-triton-paged"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = -5
    batch_invariant: ClassVar[bool] = True
    summary: ClassVar[str] = "batch-invariant paged MHA/GQA/MQA attention (Triton, CUDA)"

    @classmethod
    def can_implement(cls, request: AttentionRequest, device: DeviceCapability) -> Verdict:
        return Verdict.all(
            super().can_implement(request, device),
            runs_on_cuda(device),
            Verdict.check(request.head_dim <= _MAX_HEAD_DIM,
                          f"needs head_dim <= {_MAX_HEAD_DIM}, request has "
                          f"{request.head_dim}"),
        )

    def forward(self, query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        from kernelbay_batch_invariant.kernels import paged_attention, token_positions

        r = self.request
        seq, visible = token_positions(metadata.query_start_loc, metadata.seq_lens)
        return paged_attention(query, cache[:, 0], cache[:, 1], metadata.block_tables, seq,
                               visible, scale, r.head_dim, r.page_size, r.sliding_window,
                               split_size(r.head_dim))


class BatchInvariantMLAAttention(TorchMLAAttention):
    """Absorbed MLA over the core's latent layout, batch invariant (Triton): keys are the
    whole latent, values its first ``kv_lora_rank`` columns."""

    name: ClassVar[str] = "bi-triton-mla"
    api_version: ClassVar[str] = "1.0"
    # Above the plain-torch MLA references (which also declare batch invariance but run
    # each sequence's queries as one matmul, whose order can depend on the query count).
    priority: ClassVar[int] = 6
    batch_invariant: ClassVar[bool] = True
    summary: ClassVar[str] = "batch-invariant paged MLA attention (Triton, CUDA)"

    @classmethod
    def can_implement(cls, request: AttentionRequest, device: DeviceCapability) -> Verdict:
        return Verdict.all(super().can_implement(request, device), runs_on_cuda(device))

    def forward(self, query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        from kernelbay_batch_invariant.kernels import paged_attention, token_positions

        r = self.request
        latent = cache.unsqueeze(2)                     # [pages, page_size, 1, rank + rope]
        seq, visible = token_positions(metadata.query_start_loc, metadata.seq_lens)
        return paged_attention(query, latent, latent, metadata.block_tables, seq, visible,
                               scale, r.kv_lora_rank or 0, r.page_size, r.sliding_window,
                               split_size(self.latent_dim))
