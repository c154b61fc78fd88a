"""The ``mla-triton`` attention backend: the Triton decode and cache-write kernels on
compute capability 9.0+ GPUs, for every record kind.

Torch and triton are imported only when the backend runs; ``can_implement`` looks for
triton without importing it.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, ClassVar

from kernelbay.layers import AttentionMetadata
from kernelbay.requests import AttentionRequest
from kernelbay.verdict import Verdict

from kernelbay_attn_flashmla.backend import MLAReferenceAttention, record_for

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

    from kernelbay_attn_flashmla.records import MLARecord

__all__ = ["KERNEL_DTYPES", "MAX_KV_LORA_RANK", "MAX_ROPE_DIM", "MIN_KV_LORA_RANK",
           "MLATritonAttention", "decode_kernel_note"]

#: Query dtypes the kernel takes (its dots run in bfloat16 with float32 accumulation).
KERNEL_DTYPES = ("bfloat16", "float16")
#: Latent widths one program holds in registers: nope [16, 1024] accumulators at most.
MIN_KV_LORA_RANK = 16
MAX_KV_LORA_RANK = 1024
MAX_ROPE_DIM = 256


def decode_kernel_note(request: AttentionRequest, record: MLARecord,
                       device: DeviceCapability) -> str:
    """Which kernel decodes this layer's records on ``device`` (a note for ``explain
    --verbose``): the CUDA kernel where its conditions hold here (records, dtype, pages,
    top-k lists, device, NVRTC found on this machine), else the Triton kernel and why. Per-call
    conditions (the cache's alignment, a build that fails on the device) can still send a
    call to the Triton kernel."""
    from kernelbay.cuda_jit import find_nvrtc

    from kernelbay_attn_flashmla.cuda_mla import KINDS, static_reason

    if record.kind not in KINDS:
        return "decode: Triton kernel"

    why = static_reason(record, request.dtype, request.sparse_topk is not None,
                        request.page_size)
    if why is None and (device.platform != "cuda" or not device.cc_at_least(8, 0)):
        why = f"not on {device.platform} {device.arch}"
    if why is None and find_nvrtc() is None:
        why = "no NVRTC on this machine"
    return ("decode: CUDA kernel (NVRTC)" if not why
            else f"decode: Triton kernel (the CUDA kernel: {why})")


class MLATritonAttention(MLAReferenceAttention):
    """Absorbed MLA over paged records with Triton kernels (compute capability 9.0+).

    Same layouts and results as ``mla-reference`` (the class it extends): the decode kernel
    reads records from the pages, dequantizes in registers, attends with all heads of a
    block (up to 32) in one program per KV tile, and splits long contexts over the SMs with
    a combine step; the write kernel quantizes latents into records bit for bit as the
    reference codec. The E4M3 records (mxfp8, fp8-e8m0, fp8 at the dims ``cuda_mla`` names)
    with bfloat16 queries decode through a CUDA kernel compiled at run time by NVRTC
    (``cuda_mla``; top-k lists over fp8 and mxfp8 records too); without NVRTC, or where its
    build fails, the Triton kernel serves them. ``forward`` takes ``num_splits`` (None: chosen
    from batch x heads vs SM count) and ``topk_indices`` like the reference.
    """

    name: ClassVar[str] = "mla-triton"
    priority: ClassVar[int] = 20
    # The split count follows batch x head blocks against the SM count, and the combine sums
    # the splits' partials: a token's result depends on what else is in the batch.
    batch_invariant: ClassVar[bool] = False
    summary: ClassVar[str] = ("MLA decode over bf16/fp8/fp8-e8m0/mxfp8 KV records, Triton "
                              "split-KV kernel (E4M3 records: a CUDA kernel built by NVRTC), "
                              "CUDA cc >= 9.0")

    @classmethod
    def can_implement(cls, request: AttentionRequest, device: DeviceCapability) -> Verdict:
        base = super().can_implement(request, device)
        if not base.accepted:
            return base
        r = request
        record = record_for(r)
        assert not isinstance(record, str)  # the reference accepted it
        page_pow2 = r.page_size >= 1 and r.page_size & (r.page_size - 1) == 0
        verdict = Verdict.all(
            Verdict.check(device.cc_at_least(9, 0),
                          f"needs a CUDA device of compute capability >= 9.0, device is "
                          f"{device.platform} {device.arch}"
                          + (f" (compute capability {device.cc_text})"
                             if device.platform == "cuda" else "")),
            Verdict.check(importlib.util.find_spec("triton") is not None,
                          "needs the triton package, which is not installed "
                          "(pip install triton)"),
            Verdict.check(r.dtype in KERNEL_DTYPES,
                          f"computes for query dtypes {list(KERNEL_DTYPES)}, request has "
                          f"{r.dtype!r}"),
            Verdict.check(MIN_KV_LORA_RANK <= record.kv_lora_rank <= MAX_KV_LORA_RANK,
                          f"holds kv_lora_rank in [{MIN_KV_LORA_RANK}, {MAX_KV_LORA_RANK}], "
                          f"request has {record.kv_lora_rank}"),
            Verdict.check(record.rope_dim <= MAX_ROPE_DIM,
                          f"holds rope_dim <= {MAX_ROPE_DIM}, request has {record.rope_dim}"),
            Verdict.check(page_pow2,
                          f"needs page_size a power of two (tiles index pages by shift), "
                          f"request has {r.page_size}"),
        )
        if not verdict.accepted:
            return verdict
        return Verdict.all(verdict, Verdict.accept(decode_kernel_note(r, record, device)))

    def write_kv(self, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                 slot_mapping: torch.Tensor) -> None:
        """Encode the latents ``key`` [T, kv_lora_rank + rope_dim] into their slots (Triton)."""
        from kernelbay_attn_flashmla.triton_mla import mla_write

        latent = self.latents(key, value, slot_mapping)
        mla_write(cache, self.record, self.request.page_size, latent, slot_mapping)

    def forward_with_lse(self, query: torch.Tensor, cache: torch.Tensor,
                         metadata: AttentionMetadata, scale: float, *,
                         num_splits: int | None = None,
                         topk_indices: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` plus the log-sum-exp of the scores ``[T, H]`` (float32)."""
        from kernelbay_attn_flashmla.triton_mla import mla_decode

        r = self.request
        self._check_call(query, topk_indices)
        return mla_decode(query, cache, self.record, r.page_size, metadata, scale,
                          num_splits=num_splits, topk_indices=topk_indices,
                          sliding_window=r.sliding_window)
