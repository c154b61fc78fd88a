"""The hook specifications: the only contract plugins implement.

Each hook returns the classes a plugin offers; none is ``firstresult``, because selection
must see every candidate. A plugin module also declares ``KERNELBAY_PLUGIN_API = "1.0"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from kernelbay.layers import (
        AttentionBackend,
        CheckpointFormat,
        Collective,
        DeviceProbe,
        LinearMethod,
        Proposer,
    )

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec"]

PROJECT_NAME = "kernelbay"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Decorate plugin functions with this to implement a hook.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def kernelbay_checkpoint_formats() -> Sequence[type[CheckpointFormat]]:
    """Return the checkpoint format handlers this plugin offers."""
    raise NotImplementedError


@hookspec
def kernelbay_linear_methods() -> Sequence[type[LinearMethod]]:
    """Return the linear methods this plugin offers."""
    raise NotImplementedError


@hookspec
def kernelbay_attention_backends() -> Sequence[type[AttentionBackend]]:
    """Return the attention backends this plugin offers."""
    raise NotImplementedError


@hookspec
def kernelbay_proposers() -> Sequence[type[Proposer]]:
    """Return the speculative proposers this plugin offers."""
    raise NotImplementedError


@hookspec
def kernelbay_collectives() -> Sequence[type[Collective]]:
    """Return the collectives this plugin offers."""
    raise NotImplementedError


@hookspec
def kernelbay_device_probes() -> Sequence[DeviceProbe]:
    """Return probes that describe device types the core does not know."""
    raise NotImplementedError
