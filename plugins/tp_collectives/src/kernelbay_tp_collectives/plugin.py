"""Entry point of kernelbay-tp-collectives: ``tp-symm-mem-two-shot`` and
``tp-fused-gemm-all-reduce``.

Discovery imports this module; it and the class modules import no torch at module level.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kernelbay import hookimpl

if TYPE_CHECKING:
    from kernelbay.layers import Collective

KERNELBAY_PLUGIN_API = "1.0"


@hookimpl
def kernelbay_collectives() -> Sequence[type[Collective]]:
    """The symmetric-memory all-reduce and the fused GEMM + all-reduce."""
    from kernelbay_tp_collectives.fused import FusedGemmAllReduce
    from kernelbay_tp_collectives.two_shot import SymmMemTwoShotAllReduce

    return [SymmMemTwoShotAllReduce, FusedGemmAllReduce]
