"""Which distribution of ours handles what, so an error can say what to install.

Data only: the core never imports a plugin from here.
"""

from __future__ import annotations

from typing import Any

from kernelbay.kinds import BackendKind

__all__ = ["suggest_distribution"]

_LINEAR_SCHEMES = {
    "nvfp4": "kernelbay-quant-nvfp4",
    "fp8-block": "kernelbay-quant-nvfp4",
    "mxfp4": "kernelbay-quant-mxfp4-rocm",
    "fp8": "kernelbay-cpu-amx",
}
_FORMATS = {
    "modelopt": "kernelbay-quant-nvfp4",
    "compressed-tensors": "kernelbay-quant-nvfp4",
    "quark": "kernelbay-quant-mxfp4-rocm",
    "fp8": "kernelbay-cpu-amx",
}
_KV_RECORDS = {"fp8": "kernelbay-attn-flashmla", "fp8-e8m0": "kernelbay-attn-flashmla",
               "mxfp8": "kernelbay-attn-flashmla"}
_PROPOSERS = {"dflash2": "kernelbay-spec-dflash2"}


def suggest_distribution(kind: BackendKind, request: Any) -> str | None:
    """The distribution that offers a backend for ``request``, when one of ours does."""
    if kind is BackendKind.LINEAR:
        return _LINEAR_SCHEMES.get(getattr(getattr(request, "scheme", None), "name", ""))
    if kind is BackendKind.CHECKPOINT_FORMAT:
        return _FORMATS.get(getattr(request, "quant_method", None) or "")
    if kind is BackendKind.ATTENTION:
        if getattr(request, "attention", "") == "mla":
            return "kernelbay-attn-flashmla"
        return _KV_RECORDS.get(getattr(request, "kv_cache", ""))
    if kind is BackendKind.PROPOSER:
        return _PROPOSERS.get(getattr(request, "method", ""))
    return None
