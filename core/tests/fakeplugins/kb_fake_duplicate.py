"""Two fake plugins in one module that both register the backend name 'fake-dup'."""

from __future__ import annotations

from kernelbay import Verdict, hookimpl
from kernelbay.layers import LinearMethod


def _make(label: str) -> type[LinearMethod]:
    class Dup(LinearMethod):
        """Duplicate name."""

        name = "fake-dup"
        api_version = "1.0"
        priority = 70
        summary = f"fake duplicate {label}"

        @classmethod
        def can_implement(cls, request: object, device: object) -> Verdict:
            return Verdict.accept()

    return Dup


class First:
    """Plugin object A."""

    KERNELBAY_PLUGIN_API = "1.0"

    @hookimpl
    def kernelbay_linear_methods(self) -> list[type[LinearMethod]]:
        return [_make("A")]


class Second:
    """Plugin object B."""

    KERNELBAY_PLUGIN_API = "1.0"

    @hookimpl
    def kernelbay_linear_methods(self) -> list[type[LinearMethod]]:
        return [_make("B")]


first = First()
second = Second()
