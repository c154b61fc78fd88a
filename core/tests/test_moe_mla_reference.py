"""The core's MoE (torch-moe) and MLA (torch-mla) references against plain torch, and the
seam between dense linears and routed-expert requests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernelbay import (
    BackendKind,
    LinearRequest,
    Policy,
    QuantScheme,
    Registry,
    parse_device,
    select,
)
from kernelbay.layers import AttentionMetadata, LinearMethod
from kernelbay.layers.moe import MOE_EXPERTS_ROLE, TorchMoE, expert_tensor
from kernelbay.layers.torch_fp8_linear import TorchFp8DequantLinear
from kernelbay.layers.torch_linear import TorchUnquantizedLinear
from kernelbay.layers.torch_mla import TorchMLAAttention
from kernelbay.requests import AttentionRequest
from torch import nn

CPU = parse_device("cpu")
CORE_ONLY = Registry(Policy(plugins=frozenset()))
FP8 = QuantScheme("fp8", "float8_e4m3fn", None, "float32")
E, H, INTER, K = 8, 64, 32, 2


def moe_request(**kw: object) -> LinearRequest:
    fields: dict[str, object] = dict(in_features=H, out_features=INTER,
                                     activation_dtype="float32", role=MOE_EXPERTS_ROLE,
                                     num_experts=E)
    fields.update(kw)
    return LinearRequest(**fields)  # type: ignore[arg-type]


# -- the seam -----------------------------------------------------------------------------

@pytest.mark.parametrize("cls, scheme", [(TorchUnquantizedLinear, QuantScheme("unquantized")),
                                         (TorchFp8DequantLinear, FP8)])
def test_plain_linears_reject_moe_requests(cls: type[LinearMethod], scheme: QuantScheme) -> None:
    verdict = cls.can_implement(moe_request(scheme=scheme), CPU)
    assert not verdict.accepted and not verdict.applicable
    assert "dense layers only" in verdict.reason and "8" in verdict.reason
    assert cls.can_implement(LinearRequest(H, INTER, scheme, "float32"), CPU).accepted


def test_selection_routes_moe_and_dense_requests() -> None:
    moe = select(BackendKind.LINEAR, moe_request(), CPU, registry=CORE_ONLY)
    assert moe.name == "torch-moe"
    dense = select(BackendKind.LINEAR, LinearRequest(H, INTER, activation_dtype="float32"),
                   CPU, registry=CORE_ONLY)
    assert dense.name == "torch-unquantized"
    (line,) = [t for t in dense.trace if t.backend == "torch-moe"]
    assert not line.chosen and "routed-expert" in line.reason


def test_torch_moe_rejects_what_it_does_not_handle() -> None:
    quantized = TorchMoE.can_implement(moe_request(scheme=FP8), CPU)
    assert not quantized.accepted and not quantized.applicable and "fp8" in quantized.reason
    biased = TorchMoE.can_implement(moe_request(bias=True), CPU)
    assert not biased.accepted and biased.applicable and "bias" in biased.reason


def test_dequantized_weight() -> None:
    w = torch.randn(INTER, H)
    plain = TorchUnquantizedLinear(LinearRequest(H, INTER, activation_dtype="float32"))
    layer = nn.Module()
    plain.create_weights(layer)
    layer.weight.data.copy_(w)
    assert torch.equal(plain.dequantized_weight(layer), w)
    fp8 = TorchFp8DequantLinear(LinearRequest(H, INTER, FP8, "float32"))
    layer = nn.Module()
    fp8.create_weights(layer)
    layer.weight.data.copy_(w.to(torch.float8_e4m3fn))
    layer.weight_scale.data.fill_(0.5)
    fp8.process_weights_after_loading(layer)
    expected = w.to(torch.float8_e4m3fn).float() * 0.5
    torch.testing.assert_close(fp8.dequantized_weight(layer), expected, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="TorchMoE does not implement "
                                                  "dequantized_weight"):
        TorchMoE(moe_request()).dequantized_weight(layer)


def test_dequantized_weight_default_recovers_any_methods_weight() -> None:
    class Transposed(TorchUnquantizedLinear):
        """Keeps only a transposed copy and a bias: the default must still find W."""

        def process_weights_after_loading(self, layer: nn.Module) -> None:
            layer.weight_t = layer.weight.detach().t().contiguous()

        def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return x @ layer.weight_t + layer.bias

    for bias in (False, True):
        method = Transposed(LinearRequest(H, INTER, activation_dtype="float32", bias=bias))
        layer = nn.Module()
        method.create_weights(layer)
        if not bias:
            layer.bias = torch.zeros(INTER)
        w = torch.randn(INTER, H)
        layer.weight.data.copy_(w)
        if bias:
            layer.bias.data.normal_(0, 3.0)
        method.process_weights_after_loading(layer)
        dense = super(TorchUnquantizedLinear, method).dequantized_weight(layer)
        if bias:  # (w + b) - b rounds: within one ulp of |w| + |b|
            torch.testing.assert_close(dense, w, rtol=0, atol=1e-5)
        else:
            assert torch.equal(dense, w)


# -- torch-moe ----------------------------------------------------------------------------

def _experts(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {expert_tensor(e, p): torch.randn(shape, generator=gen) * 0.2
            for e in range(E)
            for p, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)),
                             ("down_proj", (H, INTER)))}


def _moe_layer(method: TorchMoE, tensors: dict[str, torch.Tensor]) -> nn.Module:
    layer = nn.Module()
    method.create_weights(layer)
    for name, spec in method.tensor_specs().items():
        value = tensors[name]
        r = method.request
        if spec.shard_dim is not None:  # this rank's shard, as the loader slices it
            size = spec.shape[spec.shard_dim]
            value = value.narrow(spec.shard_dim, r.tp_rank * size, size)
        getattr(layer, name).data.copy_(value)
    method.process_weights_after_loading(layer)
    return layer


def _plain_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               t: dict[str, torch.Tensor]) -> torch.Tensor:
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[row, slot])
            h = (F.silu(x[row] @ t[expert_tensor(e, "gate_proj")].T)
                 * (x[row] @ t[expert_tensor(e, "up_proj")].T))
            out[row] += weights[row, slot] * (h @ t[expert_tensor(e, "down_proj")].T)
    return out


def _routing(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E - 2, generator=gen)[:K] for _ in range(tokens)])
    return ids, torch.rand(tokens, K, generator=gen) * 2  # experts 6, 7 never chosen


def test_torch_moe_matches_plain_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = _experts(gen)
    method = TorchMoE(moe_request())
    assert set(method.tensor_specs()) == set(tensors)
    layer = _moe_layer(method, tensors)
    assert tuple(layer.w13.shape) == (E, 2 * INTER, H)
    assert tuple(layer.w2.shape) == (E, H, INTER)
    assert not any(name.startswith("experts.") for name, _ in layer.named_parameters())
    x = torch.randn(13, H, generator=gen)
    ids, weights = _routing(13, gen)
    out = method.apply_moe(layer, x, ids, weights)
    torch.testing.assert_close(out, _plain_moe(x, ids, weights, tensors), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="apply_moe"):
        method.apply(layer, x)


def test_torch_moe_tensor_parallel_shards_sum_to_the_whole() -> None:
    gen = torch.Generator().manual_seed(1)
    tensors = _experts(gen)
    x = torch.randn(9, H, generator=gen)
    ids, weights = _routing(9, gen)
    parts = []
    for rank in range(2):
        method = TorchMoE(moe_request(out_features=INTER // 2, parallel="column",
                                      tp_rank=rank, tp_size=2))
        specs = method.tensor_specs()
        assert specs[expert_tensor(3, "gate_proj")].shard_dim == 0
        assert specs[expert_tensor(3, "down_proj")].shard_dim == 1
        assert specs[expert_tensor(3, "down_proj")].shape == (H, INTER // 2)
        parts.append(method.apply_moe(_moe_layer(method, tensors), x, ids, weights))
    torch.testing.assert_close(parts[0] + parts[1], _plain_moe(x, ids, weights, tensors),
                               rtol=1e-5, atol=1e-5)


# -- torch-mla ----------------------------------------------------------------------------

RANK, ROPE, HEADS, PAGE = 32, 8, 4, 4


def mla_request(**kw: object) -> AttentionRequest:
    fields: dict[str, object] = dict(attention="mla", num_heads=HEADS, num_kv_heads=1,
                                     head_dim=24, v_head_dim=16, kv_lora_rank=RANK,
                                     rope_dim=ROPE, dtype="float32", page_size=PAGE)
    fields.update(kw)
    return AttentionRequest(**fields)  # type: ignore[arg-type]


def _ragged_batch(backend: TorchMLAAttention, gen: torch.Generator, contexts: list[int],
                  news: list[int], num_pages: int
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[torch.Tensor]]:
    """Latents of every context token written into random pages; queries for the last
    ``news[b]`` tokens of each sequence."""
    dim = backend.latent_dim
    cache = backend.allocate_cache(num_pages, "cpu")
    free = torch.randperm(num_pages, generator=gen).tolist()
    width = max(-(-c // PAGE) for c in contexts)
    tables = torch.zeros(len(contexts), width, dtype=torch.int32)
    latents, slots, starts = [], [], [0]
    for b, context in enumerate(contexts):
        pages = [free.pop() for _ in range(-(-context // PAGE))]
        tables[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        latent = torch.randn(context, dim, generator=gen)
        seq_slots = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(context)])
        backend.write_kv(cache, latent, None, seq_slots)   # earlier steps (and this one)
        latents.append(latent.to(cache.dtype).float())
        slots.append(seq_slots[context - news[b]:])
        starts.append(starts[-1] + news[b])
    query = torch.randn(sum(news), HEADS, dim, generator=gen)
    meta = AttentionMetadata(torch.tensor(starts, dtype=torch.int32),
                             torch.tensor(contexts, dtype=torch.int32), tables,
                             torch.cat(slots))
    return query, cache, meta, latents


def _plain_mla(query: torch.Tensor, latents: list[torch.Tensor], news: list[int],
               scale: float, window: int | None = None) -> torch.Tensor:
    outs, start = [], 0
    for latent, new in zip(latents, news, strict=True):
        q = query[start:start + new]
        context = latent.shape[0]
        scores = torch.einsum("lhd,cd->lhc", q, latent) * scale
        q_pos = torch.arange(context - new, context)[:, None, None]
        k_pos = torch.arange(context)[None, None, :]
        hidden = (k_pos > q_pos) | (k_pos <= q_pos - window if window else False)
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("lhc,cr->lhr", scores.softmax(-1), latent[:, :RANK]))
        start += new
    return torch.cat(outs)


@pytest.mark.parametrize("kv_cache, cache_dtype", [("auto", torch.float32),
                                                   ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("contexts, news", [
    ([7, 20, 11, 1], [7, 1, 3, 1]),  # prefill, decode, chunk, first token
    ([7, 20, 1, 33], [1, 1, 1, 1]),  # decode only: the batch at once, keys padded
])
def test_torch_mla_matches_plain_torch(kv_cache: str, cache_dtype: torch.dtype,
                                       contexts: list[int], news: list[int]) -> None:
    backend = TorchMLAAttention(mla_request(kv_cache=kv_cache))
    assert TorchMLAAttention.can_implement(backend.request, CPU).accepted
    gen = torch.Generator().manual_seed(2)
    query, cache, meta, latents = _ragged_batch(backend, gen, contexts, news, 24)
    assert cache.dtype == cache_dtype and tuple(cache.shape) == (24, PAGE, RANK + ROPE)
    out = backend.forward(query, cache, meta, 0.3)
    assert out.shape == (sum(news), HEADS, RANK) and out.dtype == query.dtype
    torch.testing.assert_close(out, _plain_mla(query, latents, news, 0.3), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("news", [[1, 1, 1, 1], [1, 4, 1, 2]])
def test_torch_mla_sliding_window_matches_plain_torch(news: list[int]) -> None:
    backend = TorchMLAAttention(mla_request(sliding_window=5))
    gen = torch.Generator().manual_seed(3)
    contexts = [7, 20, 1, 33]
    query, cache, meta, latents = _ragged_batch(backend, gen, contexts, news, 24)
    torch.testing.assert_close(backend.forward(query, cache, meta, 0.3),
                               _plain_mla(query, latents, news, 0.3, window=5), rtol=1e-5,
                               atol=1e-5)


def test_torch_mla_layout_and_rejections() -> None:
    assert TorchMLAAttention(mla_request()).kv_layout().bytes_per_token == (RANK + ROPE) * 4
    bf16 = TorchMLAAttention(mla_request(dtype="bfloat16")).kv_layout()
    assert bf16.bytes_per_token == (RANK + ROPE) * 2 and bf16.record == "bf16"
    fp8 = TorchMLAAttention.can_implement(mla_request(kv_cache="fp8"), CPU)
    assert not fp8.accepted and fp8.applicable and "'fp8'" in fp8.reason
    gqa = TorchMLAAttention.can_implement(AttentionRequest("gqa", 4, 2, 16), CPU)
    assert not gqa.accepted and not gqa.applicable
    with pytest.raises(ValueError, match="value=None"):
        TorchMLAAttention(mla_request()).write_kv(torch.zeros(1, PAGE, RANK + ROPE),
                                                  torch.zeros(1, RANK + ROPE),
                                                  torch.zeros(1, 1), torch.zeros(1))


def test_torch_mla_agrees_with_the_flashmla_reference() -> None:
    plugin = pytest.importorskip("kernelbay_attn_flashmla.backend")
    request = AttentionRequest("mla", HEADS, 1, 192, 128, 512, 64, dtype="bfloat16",
                               page_size=PAGE)
    ours, theirs = TorchMLAAttention(request), plugin.MLAReferenceAttention(request)
    assert ours.kv_layout().bytes_per_token == theirs.kv_layout().bytes_per_token
    gen = torch.Generator().manual_seed(3)
    contexts, news = [5, 9], [5, 2]
    query, cache, meta, _ = _ragged_batch(ours, gen, contexts, news, 8)
    query = query.to(torch.bfloat16)
    their_cache = theirs.allocate_cache(8, "cpu")
    for b, context in enumerate(contexts):
        pages = meta.block_tables[b].long()
        slots = torch.tensor([int(pages[p // PAGE]) * PAGE + p % PAGE for p in range(context)])
        latent = cache[slots // PAGE, slots % PAGE]
        theirs.write_kv(their_cache, latent, None, slots)
    torch.testing.assert_close(ours.forward(query, cache, meta, 0.07).float(),
                               theirs.forward(query, their_cache, meta, 0.07).float(),
                               rtol=1e-2, atol=1e-2)
