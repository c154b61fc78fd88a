"""A well-behaved fake plugin: one linear method that accepts float32 activations only."""

from __future__ import annotations

from kernelbay import LinearRequest, Verdict, hookimpl
from kernelbay.layers import LinearMethod

KERNELBAY_PLUGIN_API = "1.0"


class Fp32OnlyLinear(LinearMethod):
    """Accepts unquantized layers with float32 activations."""

    name = "fake-fp32-only"
    api_version = "1.0"
    priority = 50
    summary = "fake: float32 activations only"

    @classmethod
    def can_implement(cls, request: LinearRequest, device: object) -> Verdict:
        return Verdict.check(request.activation_dtype == "float32",
                             f"needs float32 activations, request has "
                             f"{request.activation_dtype!r}")


@hookimpl
def kernelbay_linear_methods() -> list[type[LinearMethod]]:
    return [Fp32OnlyLinear]
