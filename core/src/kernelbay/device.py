"""Device capability: what the hardware can do, probed lazily or described by a spec string.

Probing never happens at import. ``probe_device()`` imports torch only when it runs, and
caches its answer. ``parse_device("sm_100")`` describes hardware you don't have, so plans
can be made for it (``KERNELBAY_DEVICE`` / ``--device``).
"""

from __future__ import annotations

import functools
import os
import platform as _platform
import re
from dataclasses import dataclass, field, replace
from typing import final

from kernelbay.errors import ConfigError

__all__ = [
    "CPU_FLAGS_OF_INTEREST",
    "DeviceCapability",
    "parse_device",
    "probe_cpu",
    "probe_device",
]

#: CPU flags (as /proc/cpuinfo spells them) that backends decide on.
CPU_FLAGS_OF_INTEREST = frozenset(
    {
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_bf16",
        "avx512_fp16",
        "avx512_vnni",
        "avx512vbmi",
        "amx_bf16",
        "amx_int8",
        "amx_tile",
        "amx_fp16",
        "asimd",
        "sve",
        "sve2",
        "bf16",
    }
)

# ISA implied by a named CPU class in a device spec ("cpu+amx").
_CPU_SPEC_GROUPS = {
    "amx": frozenset({"amx_bf16", "amx_int8", "amx_tile", "avx512f", "avx512bw", "avx512vl",
                      "avx512_bf16", "avx512_vnni", "avx2", "fma"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma"}),
    "avx512_bf16": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma"}),
    "avx2": frozenset({"avx2", "fma"}),
}

# Facts known about named ROCm architectures.
_ROCM_ISA = {
    "gfx950": frozenset({"mfma", "native_mx", "fp8"}),
    "gfx942": frozenset({"mfma", "fp8"}),
    "gfx90a": frozenset({"mfma"}),
}


@final
@dataclass(frozen=True)
class DeviceCapability:
    """Facts about one device (and its host) that backends decide on.

    ``platform`` is ``"cuda"``, ``"rocm"``, ``"cpu"`` or a vendor's own name; ``arch`` is
    e.g. ``"sm_90"``, ``"gfx942"`` or ``"x86_64"``. ``source`` says whether the facts were
    probed or described by a spec string.
    """

    platform: str
    arch: str
    compute_capability: tuple[int, int] | None = None
    isa: frozenset[str] = field(default_factory=frozenset)
    name: str = ""
    memory_bytes: int | None = None
    device_count: int = 1
    p2p: bool | None = None
    multicast: bool | None = None
    source: str = "probed"

    @property
    def is_gpu(self) -> bool:
        """True for CUDA and ROCm devices."""
        return self.platform in ("cuda", "rocm")

    def has(self, flag: str) -> bool:
        """True when the ISA flag (``amx_bf16``, ``native_mx`` ...) is present."""
        return flag in self.isa

    def cc_at_least(self, major: int, minor: int = 0) -> bool:
        """True on a CUDA device whose compute capability is at least ``major.minor``."""
        return (self.platform == "cuda" and self.compute_capability is not None
                and self.compute_capability >= (major, minor))

    @property
    def cc_text(self) -> str:
        """Compute capability as ``"9.0"``, or ``"none"``."""
        if self.compute_capability is None:
            return "none"
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    def describe(self) -> str:
        """One line such as ``cuda sm_90 (NVIDIA H200), compute capability 9.0, 1 device``."""
        parts = [f"{self.platform} {self.arch}"]
        if self.name:
            parts[0] += f" ({self.name})"
        if self.compute_capability is not None:
            parts.append(f"compute capability {self.cc_text}")
        if self.device_count != 1:
            parts.append(f"{self.device_count} devices")
        if self.memory_bytes:
            parts.append(f"{self.memory_bytes / 2**30:.0f} GiB")
        text = ", ".join(parts)
        return text if self.source == "probed" else f"{text} ({self.source})"

    def as_dict(self) -> dict[str, object]:
        """JSON-ready facts (stable keys)."""
        return {
            "platform": self.platform,
            "arch": self.arch,
            "compute_capability": self.cc_text if self.compute_capability else None,
            "isa": sorted(self.isa),
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "device_count": self.device_count,
            "p2p": self.p2p,
            "multicast": self.multicast,
            "source": self.source,
        }


_SPEC_RE = re.compile(r"^(?P<base>sm_\d{2,3}|gfx[0-9a-f]{3,4}|cpu)(?:x(?P<count>\d+))?"
                      r"(?P<flags>(\+[A-Za-z0-9_]+)*)$", re.IGNORECASE)
_VALID_SPECS = ("sm_<major><minor> (sm_80, sm_90, sm_100, sm_120)", "gfx942", "gfx950",
                "cpu", "cpu+amx", "cpu+avx512_bf16", "cpu+avx2",
                "<base>x<count> for several devices (sm_90x2)",
                "+multicast / +p2p / +<isa flag> modifiers")


def parse_device(spec: str) -> DeviceCapability:
    """Describe a device from a spec string such as ``sm_90``, ``gfx950`` or ``cpu+amx``.

    Raises ``ConfigError`` naming the spec and the valid forms when it cannot be read.
    """
    text = spec.strip()
    match = _SPEC_RE.match(text)
    if not match:
        raise ConfigError(f"device spec {spec!r} is not understood; valid forms: "
                          + "; ".join(_VALID_SPECS))
    base = match.group("base").lower()
    count = int(match.group("count") or 1)
    flags = [f for f in (match.group("flags") or "").split("+") if f]
    multicast = "multicast" in flags or None
    p2p = True if ("p2p" in flags or multicast) else None
    extra = frozenset(f for f in flags if f not in ("multicast", "p2p"))
    described = f"described by {text!r}"
    if base.startswith("sm_"):
        digits = base[3:]
        cc = (int(digits[:-1]), int(digits[-1]))
        if count > 1 and p2p is None:
            p2p = True
        return DeviceCapability("cuda", base, cc, extra, "", None, count,
                                p2p, bool(multicast), described)
    if base.startswith("gfx"):
        isa = _ROCM_ISA.get(base, frozenset()) | extra
        return DeviceCapability("rocm", base, None, isa, "", None, count,
                                p2p, bool(multicast), described)
    if base == "cpu":
        cpu_isa: frozenset[str] = frozenset()
        unknown = []
        for flag in extra:
            if flag in _CPU_SPEC_GROUPS:
                cpu_isa |= _CPU_SPEC_GROUPS[flag]
            elif flag in CPU_FLAGS_OF_INTEREST:
                cpu_isa |= {flag}
            else:
                unknown.append(flag)
        if unknown:
            valid = sorted(set(_CPU_SPEC_GROUPS) | CPU_FLAGS_OF_INTEREST)
            raise ConfigError(f"device spec {spec!r}: unknown CPU feature(s) {sorted(unknown)}; "
                              f"valid: {valid}")
        return DeviceCapability("cpu", "x86_64", None, cpu_isa, "", None, count,
                                None, None, described)
    raise ConfigError(f"device spec {spec!r} is not understood; valid forms: "
                      + "; ".join(_VALID_SPECS))


def _read_cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split()) & CPU_FLAGS_OF_INTEREST
    except OSError:
        pass
    return frozenset()


def _cpu_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@functools.cache
def probe_cpu() -> DeviceCapability:
    """Facts about this machine's CPU (ISA flags, memory), also on a host with GPUs. Cached."""
    return _probe_cpu()


def _probe_cpu() -> DeviceCapability:
    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return DeviceCapability("cpu", _platform.machine() or "unknown", None, _read_cpu_flags(),
                            name, _cpu_memory(), 1, None, None, "probed")


#: Environment switches with which a host turns multicast (NVLS) off for every library.
MULTICAST_OFF_SWITCHES = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                          "NVSHMEM_DISABLE_NVLS": "1"}


def _probe_multicast(index: int) -> bool | None:
    # A host that switched multicast off has none, whatever the driver could do.
    if any(os.environ.get(k, "").strip() == v for k, v in MULTICAST_OFF_SWITCHES.items()):
        return False
    # Private API: answer "unknown" rather than fail if this torch lacks it.
    try:
        from torch._C._autograd import DeviceType
        from torch._C._distributed_c10d import _SymmetricMemory

        return bool(_SymmetricMemory.has_multicast_support(DeviceType.CUDA, index))
    except Exception:
        return None


def _probe_gpu(index: int) -> DeviceCapability | None:
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    count = torch.cuda.device_count()
    p2p = None
    if count > 1:
        p2p = bool(torch.cuda.can_device_access_peer(0, 1))
    if getattr(torch.version, "hip", None):
        arch = str(getattr(props, "gcnArchName", "gfx")).split(":")[0]
        return DeviceCapability("rocm", arch, None, _ROCM_ISA.get(arch, frozenset()),
                                props.name, props.total_memory, count, p2p, None, "probed")
    cc = (props.major, props.minor)
    return DeviceCapability("cuda", f"sm_{props.major}{props.minor}", cc, frozenset(),
                            props.name, props.total_memory, count, p2p,
                            _probe_multicast(index), "probed")


@functools.cache
def probe_device(index: int = 0) -> DeviceCapability:
    """Probe the device this process would compute on (GPU ``index`` if there is one).

    Imports torch on first call, never CUDA-initialises at import; cached per index.
    """
    try:
        gpu = _probe_gpu(index)
    except ImportError:
        gpu = None
    return gpu if gpu is not None else probe_cpu()


def with_count(device: DeviceCapability, count: int) -> DeviceCapability:
    """The same device facts, for ``count`` devices (planning tensor parallel)."""
    return replace(device, device_count=count)
