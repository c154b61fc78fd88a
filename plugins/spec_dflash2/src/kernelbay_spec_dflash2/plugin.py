"""Entry point of kernelbay-spec-dflash2: the ``dflash2`` proposer.

Discovery imports this module; it and ``proposer`` import no torch at module level.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kernelbay import hookimpl

if TYPE_CHECKING:
    from kernelbay.layers import Proposer

KERNELBAY_PLUGIN_API = "1.0"


@hookimpl
def kernelbay_proposers() -> Sequence[type[Proposer]]:
    """The DFlash2 block drafter."""
    from kernelbay_spec_dflash2.proposer import DFlash2Proposer

    return [DFlash2Proposer]
