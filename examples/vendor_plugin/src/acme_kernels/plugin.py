"""Entry point of the acme plugin: declares the plugin API it targets and its backends.

Discovery imports this module, so it imports nothing heavy: the backend class module
imports torch only inside its methods.
"""

from __future__ import annotations

from kernelbay import hookimpl
from kernelbay.layers import LinearMethod

from acme_kernels.upcast_linear import Fp32UpcastLinear

#: The kernelbay plugin API this plugin was written against.
KERNELBAY_PLUGIN_API = "1.0"


@hookimpl
def kernelbay_linear_methods() -> list[type[LinearMethod]]:
    """The acme linear methods."""
    return [Fp32UpcastLinear]
