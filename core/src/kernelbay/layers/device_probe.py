"""Device probes: how a vendor plugin describes a device type the core does not know."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kernelbay.device import DeviceCapability

__all__ = ["DeviceProbe"]


@runtime_checkable
class DeviceProbe(Protocol):
    """Returned by ``kernelbay_device_probes``. ``name`` identifies the probe in traces."""

    name: str

    def probe(self) -> DeviceCapability | None:
        """Facts about the vendor device present here, or ``None`` if there is none."""

    def parse(self, spec: str) -> DeviceCapability | None:
        """Describe a device from a spec string this vendor owns, or ``None`` if not its own."""
