"""kernelbay: a small core that defines LLM inference backends and picks installed plugins
at run time from the device and the checkpoint.

``import kernelbay`` imports no torch, no triton and no plugin: those load when needed.
"""

from kernelbay._version import PLUGIN_API_VERSION, __version__
from kernelbay.backend import Backend
from kernelbay.device import DeviceCapability, parse_device, probe_device
from kernelbay.errors import (
    CheckpointError,
    ConfigError,
    ForcedBackendError,
    KernelbayError,
    NoBackendError,
    PluginError,
)
from kernelbay.hookspecs import hookimpl
from kernelbay.kinds import BackendKind
from kernelbay.plugins import Candidate, PluginRecord, PluginStatus, Registry, get_registry
from kernelbay.policy import Policy
from kernelbay.requests import (
    UNQUANTIZED,
    AttentionRequest,
    CollectiveRequest,
    FormatRequest,
    LayerRole,
    LinearRequest,
    ProposerRequest,
    QuantScheme,
)
from kernelbay.select import Selection, select
from kernelbay.trace import CandidateStatus, TraceLine
from kernelbay.verdict import Verdict

# The engine imports torch: load it on first use, so `import kernelbay` stays light.
_ENGINE_NAMES = ("LLM", "SamplingParams", "KVCacheConfig", "RequestOutput")


def __getattr__(name: str) -> object:
    if name in _ENGINE_NAMES:
        import kernelbay.engine

        return getattr(kernelbay.engine, name)
    raise AttributeError(f"module 'kernelbay' has no attribute {name!r}")

__all__ = [
    "LLM",
    "PLUGIN_API_VERSION",
    "UNQUANTIZED",
    "AttentionRequest",
    "Backend",
    "BackendKind",
    "Candidate",
    "CandidateStatus",
    "CheckpointError",
    "CollectiveRequest",
    "ConfigError",
    "DeviceCapability",
    "ForcedBackendError",
    "FormatRequest",
    "KVCacheConfig",
    "KernelbayError",
    "LayerRole",
    "LinearRequest",
    "NoBackendError",
    "PluginError",
    "PluginRecord",
    "PluginStatus",
    "Policy",
    "ProposerRequest",
    "QuantScheme",
    "Registry",
    "RequestOutput",
    "SamplingParams",
    "Selection",
    "TraceLine",
    "Verdict",
    "__version__",
    "get_registry",
    "hookimpl",
    "parse_device",
    "probe_device",
    "select",
]
