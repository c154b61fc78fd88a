"""Building blocks shared by the model families: linear layers that run the selected method,
RMSNorm, vocabulary-parallel embedding and LM head, and the attention layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kernelbay.engine.parallel import TensorParallel
from kernelbay.layers import AttentionBackend, AttentionMetadata, LinearMethod

__all__ = ["AttentionLayer", "ForwardMeta", "Linear", "RMSNorm", "VocabParallelEmbedding",
           "invariant_mean_square", "rowwise", "vocab_logits"]


@dataclass
class ForwardMeta:
    """What one forward pass needs besides tokens and positions."""

    attn: AttentionMetadata
    caches: list[torch.Tensor] = field(default_factory=list)


class Linear(nn.Module):
    """A linear layer whose parameters and math belong to its selected ``LinearMethod``.

    Row-parallel layers all-reduce their partial sums here, after the method runs; when a
    fusing GEMM + all-reduce collective was selected and this layer's weight is a plain
    dense matrix (``fusable``), the collective runs the GEMM and the all-reduce together.
    """

    def __init__(self, method: LinearMethod, tp: TensorParallel, device: torch.device) -> None:
        super().__init__()
        self.method = method
        self.tp = tp
        method.create_weights(self, device)

    @property
    def fusable(self) -> bool:
        """True when a fused GEMM + all-reduce may replace this layer's method: row-parallel,
        unquantized, one dense ``weight`` and no bias on this rank."""
        r = self.method.request
        weight = getattr(self, "weight", None)
        return (r.parallel == "row" and not r.scheme.is_quantized and r.num_experts is None
                and isinstance(weight, torch.Tensor) and weight.dim() == 2
                and self.method.rank_bias(self) is None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        y: torch.Tensor
        if self.method.request.parallel == "row" and self.tp.size > 1:
            fused = self.tp.gemm_collective
            if fused is not None and self.fusable and flat.dtype == self.weight.dtype:
                y = fused.gemm_all_reduce(flat, self.weight)
            else:
                y = self.tp.collective.all_reduce(self.method.apply(self, flat))
        else:
            y = self.method.apply(self, flat)
        return y.reshape(*shape[:-1], y.shape[-1])


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` on each row of ``x`` [T, ...] alone, results concatenated: a matmul the engine
    runs itself (router, MLA absorption) then sees one row whatever the batch is, so its
    library cannot pick a different kernel (and summation order) for another row count.
    Used in batch-invariant mode only: it costs one call per row."""
    if x.shape[0] <= 1:
        return fn(x)
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


def invariant_mean_square(xf: torch.Tensor) -> torch.Tensor:
    """``mean(xf^2)`` over the last dim [..., 1], summed as a fixed pairwise tree of
    elementwise adds (padded to a power of two): every row is summed in the same order
    whatever the number of rows, on any device, unlike a reduction kernel whose split of a
    row across threads may follow the tensor's shape."""
    width = xf.shape[-1]
    sq = xf * xf
    padded = 1 << max(0, (width - 1).bit_length())
    if padded != width:
        sq = F.pad(sq, (0, padded - width))
    while sq.shape[-1] > 1:
        half = sq.shape[-1] // 2
        sq = sq[..., :half] + sq[..., half:]
    return sq / width


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised in float32.

    With ``batch_invariant`` (set by the engine in batch-invariant mode) the mean of squares
    is ``invariant_mean_square``: bitwise the same for a row whatever the batch holds.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.eps = eps
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        mean_square = (invariant_mean_square(xf) if self.batch_invariant
                       else xf.pow(2).mean(-1, keepdim=True))
        xf = xf * torch.rsqrt(mean_square + self.eps)
        return self.weight * xf.to(dtype)


def _shard_rows(param: nn.Parameter) -> nn.Parameter:
    param.shard_dim = 0  # type: ignore[attr-defined]
    return param


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks (padded to a multiple of the
    world size); each rank looks up its own ids and the results are summed."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.tp = tp
        self.vocab = vocab
        #: Set by the engine in batch-invariant mode: a tied LM head then runs row by row.
        self.batch_invariant = False
        self.start, self.end = tp.shard_range(vocab)
        rows = -(-vocab // tp.size)
        self.weight = _shard_rows(nn.Parameter(torch.zeros(rows, hidden, dtype=dtype,
                                                           device=device),
                                               requires_grad=False))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (ids >= self.start) & (ids < self.end)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        summed: torch.Tensor = self.tp.collective.all_reduce(out)
        return summed


def vocab_logits(x: torch.Tensor, head: Linear | None, embed: VocabParallelEmbedding
                 ) -> torch.Tensor:
    """Logits of the full vocabulary: this rank's shard from the LM head (or the tied
    embedding when ``head`` is None), gathered across ranks, padding removed."""
    if head is not None:
        logits: torch.Tensor = head(x)
    elif embed.batch_invariant:
        logits = rowwise(lambda row: F.linear(row, embed.weight), x.reshape(-1, x.shape[-1])
                         ).reshape(*x.shape[:-1], -1)
    else:
        logits = F.linear(x, embed.weight)
    if embed.tp.size > 1:
        logits = embed.tp.gather_collective.all_gather(logits.contiguous(), dim=-1)
    return logits[..., : embed.vocab]


class AttentionLayer(nn.Module):
    """Writes the new tokens' K/V into this layer's pages, then attends with the backend."""

    def __init__(self, backend: AttentionBackend, layer_index: int, scale: float) -> None:
        super().__init__()
        self.backend = backend
        self.layer_index = layer_index
        self.scale = scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                meta: ForwardMeta) -> torch.Tensor:
        cache = meta.caches[self.layer_index]
        self.backend.write_kv(cache, key, value, meta.attn.slot_mapping)
        out: torch.Tensor = self.backend.forward(query, cache, meta.attn, self.scale)
        return out

