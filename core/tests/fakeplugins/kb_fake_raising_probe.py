"""A fake plugin whose can_implement raises."""

from __future__ import annotations

from kernelbay import Verdict, hookimpl
from kernelbay.layers import LinearMethod

KERNELBAY_PLUGIN_API = "1.0"


class RaisingLinear(LinearMethod):
    """Its probe always raises."""

    name = "fake-raising"
    api_version = "1.0"
    priority = 100
    summary = "fake: probe raises"

    @classmethod
    def can_implement(cls, request: object, device: object) -> Verdict:
        raise ZeroDivisionError("probe divided by zero")


@hookimpl
def kernelbay_linear_methods() -> list[type[LinearMethod]]:
    return [RaisingLinear]
