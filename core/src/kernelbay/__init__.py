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

__all__ = [
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
