"""Sample requests and devices the conformance suite asks every candidate about."""

from __future__ import annotations

from kernelbay.device import DeviceCapability, parse_device
from kernelbay.kinds import BackendKind
from kernelbay.requests import (
    AttentionRequest,
    CollectiveRequest,
    FormatRequest,
    LayerRole,
    LinearRequest,
    ProposerRequest,
    QuantScheme,
)

__all__ = ["SAMPLE_DEVICE_SPECS", "sample_devices", "sample_requests"]

SAMPLE_DEVICE_SPECS = ("sm_80", "sm_90", "sm_100", "sm_120", "gfx942", "gfx950", "cpu",
                       "cpu+amx", "sm_90x2")

_NVFP4 = QuantScheme("nvfp4", "e2m1", (1, 16), "float8_e4m3fn", True, None, "modelopt")
_MXFP4 = QuantScheme("mxfp4", "e2m1", (1, 32), "e8m0", False, "mxfp4-dynamic", "quark")
_FP8_BLOCK = QuantScheme("fp8-block", "float8_e4m3fn", (128, 128), "float32", False, None,
                         "modelopt")
_FP8 = QuantScheme("fp8", "float8_e4m3fn", None, "float32", False, "fp8-static", "modelopt")


def sample_devices() -> list[DeviceCapability]:
    """Devices of every platform, described (never probed)."""
    return [parse_device(s) for s in SAMPLE_DEVICE_SPECS]


def sample_requests(kind: BackendKind) -> list[object]:
    """Typical and awkward requests of ``kind``: ragged shapes, every scheme, TP shards."""
    if kind is BackendKind.LINEAR:
        shapes = [(4096, 4096), (4096, 14336), (14336, 4096), (100, 4100), (1, 1)]
        out: list[object] = []
        for scheme in (QuantScheme("unquantized"), _NVFP4, _MXFP4, _FP8_BLOCK, _FP8):
            for k, n in shapes:
                for dtype in ("bfloat16", "float16", "float32"):
                    out.append(LinearRequest(k, n, scheme, dtype, role=LayerRole.MLP_DOWN))
        out.append(LinearRequest(2048, 4096, _NVFP4, "bfloat16", False, LayerRole.ATTN_QKV,
                                 "column", 1, 2))
        out.append(LinearRequest(4096, 2048, _NVFP4, "bfloat16", True, LayerRole.MOE_EXPERT,
                                 num_experts=8))
        # Whole routed-expert MLPs (the fused-MoE seam, role "moe_experts"), one per scheme.
        for scheme in (QuantScheme("unquantized"), _NVFP4, _MXFP4, _FP8_BLOCK, _FP8):
            out.append(LinearRequest(2048, 768, scheme, "bfloat16", False, "moe_experts",
                                     "replicated", num_experts=64))
        return out
    if kind is BackendKind.ATTENTION:
        return [
            AttentionRequest("mha", 32, 32, 128),
            AttentionRequest("gqa", 32, 8, 128, kv_cache="fp16", dtype="float16"),
            AttentionRequest("mqa", 16, 1, 64, dtype="float32"),
            AttentionRequest("gqa", 28, 4, 128, page_size=64, sliding_window=4096),
            AttentionRequest("mla", 128, 1, 192, 128, 512, 64),
            AttentionRequest("mla", 16, 1, 192, 128, 512, 64, kv_cache="fp8"),
            AttentionRequest("mla", 16, 1, 192, 128, 448, 64, kv_cache="mxfp8"),
            AttentionRequest("mla", 64, 1, 192, 128, 512, 64, sparse_topk=2048),
        ]
    if kind is BackendKind.PROPOSER:
        return [ProposerRequest("ngram", 8, 32000), ProposerRequest("dflash2", 8, 259,
                                                                    "deepseek_v3", 256),
                ProposerRequest("eagle", 4, 128000)]
    if kind is BackendKind.COLLECTIVE:
        return [CollectiveRequest(op, ws, "bfloat16", t)
                for op in ("all_reduce", "all_gather", "reduce_scatter", "gemm_all_reduce")
                for ws in (1, 2, 8) for t in ("gloo", "nccl")]
    return [
        FormatRequest.from_config(None),
        FormatRequest.from_config({"quant_method": "modelopt", "quant_algo": "NVFP4",
                                   "group_size": 16, "exclude_modules": ["lm_head"]}),
        FormatRequest.from_config({"quant_method": "modelopt", "quant_algo": "FP8"}),
        FormatRequest.from_config({"quant_method": "compressed-tensors",
                                   "format": "nvfp4-pack-quantized", "config_groups": {}}),
        FormatRequest.from_config({"quant_method": "quark", "global_quant_config": {},
                                   "exclude": ["lm_head"]}),
        FormatRequest.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]}),
        FormatRequest.from_config({"quant_method": "gptq", "bits": 4}),
    ]
