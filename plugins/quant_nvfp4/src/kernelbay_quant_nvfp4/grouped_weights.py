"""The stored expert weights the grouped NVFP4 expert GEMMs read (``triton_grouped``), made
when a MoE layer loads (torch only).

Every projection keeps the layout ``nvfp4-triton`` would give one expert of its shape
(``linear_triton.stored_tensors``: ``tiles`` where N is a multiple of 16 and K of 128), stacked
over the experts. Gate and up are *paired* into one weight so that one program makes both
halves of ``SiLU(gate) * up`` in one K loop: ``turn`` gate rows, then the same ``turn`` up
rows, in turns (each projection's rows zero-padded to whole turns; padded rows decode to zero
and their outputs are never stored). On the H200 that was 1-5% faster than two K loops per
program over separate weights (``bench/results/nvfp4-moe-h200.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["ROW_UNIT", "ExpertWeight", "pair_turn", "paired_weight"]

#: Rows per unit of a stored weight's dimension 1: the tiles layout counts 16-row tiles.
ROW_UNIT = {"tiles": 16, "fragment": 1, "repacked": 1, "checkpoint": 1}
#: The widest turn: a program of 2 x 64 rows (``GroupedConfig.block_n`` 128).
MAX_TURN = 64


@dataclass(frozen=True)
class ExpertWeight:
    """One projection of every expert as the grouped kernels read it: ``words`` and
    ``scales`` (the layout's tensors, experts first: ``scales`` as uint8), ``global_scale``
    fp32 [E, 1] (``weight_scale_2``), ``n`` output features, ``k`` inputs. A paired gate/up
    weight has ``turn`` > 0, ``n`` = I, ``rows`` = 2 x I padded to whole turns, and
    ``up_scale`` the up projection's ``weight_scale_2``."""

    words: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    layout: str
    n: int
    k: int
    rows: int
    turn: int = 0
    up_scale: torch.Tensor | None = None

    def row_strides(self) -> tuple[int, int]:
        """Elements between two rows of the words and of the scales (unused when tiled)."""
        if self.layout == "tiles":
            return 0, 0
        words = self.words.reshape(self.words.shape[0], self.rows, -1)
        return int(words.stride(1)), int(self.scales.stride(1))


def expert_weight(words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                  layout: str, n: int, k: int) -> ExpertWeight:
    """``ExpertWeight`` of one stacked projection as ``linear_triton.stored_tensors`` made it
    (the checkpoint layout's uint8 bytes read as int16 halfwords, E4M3 scales as bytes)."""
    import torch

    if layout == "checkpoint":
        words = words.view(torch.int16)
    if scales.dtype == torch.float8_e4m3fn:
        scales = scales.view(torch.uint8)
    return ExpertWeight(words, scales, global_scale, layout, n, k, n)


def pair_turn(inter: int) -> int:
    """Rows per turn of a paired weight for an expert intermediate size ``inter``: 64, or the
    smallest power of two from 8 holding ``inter`` when it is smaller (a program's rows, twice
    the turn, must be at least 16 for the dot)."""
    turn = 8
    while turn < min(inter, MAX_TURN):
        turn *= 2
    return turn


def paired_weight(gate: ExpertWeight, up: ExpertWeight, turn: int) -> ExpertWeight:
    """Gate and up of every expert in one weight: ``turn`` gate rows, then the same ``turn`` up
    rows, in turns; each projection zero-padded to whole turns. ``ValueError`` unless the two
    match and ``turn`` is a whole number of the layout's row units."""
    import torch

    if gate.layout not in ROW_UNIT:
        raise ValueError(f"paired_weight: layout {gate.layout!r}; valid: {tuple(ROW_UNIT)}")
    unit = ROW_UNIT[gate.layout]
    if (gate.n, gate.k, gate.layout, gate.turn, up.turn) != (up.n, up.k, up.layout, 0, 0):
        raise ValueError(f"paired_weight: gate {gate.n}x{gate.k} ({gate.layout}, turn "
                         f"{gate.turn}) and up {up.n}x{up.k} ({up.layout}, turn {up.turn}) must "
                         "be matching single projections")
    if turn < max(8, unit) or turn & (turn - 1):
        raise ValueError(f"paired_weight: turn={turn}; valid: a power of two >= "
                         f"{max(8, unit)} (a program's rows, twice the turn, feed a dot of at "
                         f"least 16; the {gate.layout} layout stores rows in units of {unit})")
    turns = -(-gate.n // turn)

    def pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        units = turns * turn // unit
        if a.shape[1] < units:  # zero rows up to whole turns (they decode to zero)
            pad = a.new_zeros(a.shape[0], units - a.shape[1], *a.shape[2:])
            a, b = torch.cat([a, pad], 1), torch.cat([b, pad], 1)
        shape = (a.shape[0], turns, turn // unit, *a.shape[2:])
        return torch.stack([a.reshape(shape), b.reshape(shape)], 2).reshape(
            a.shape[0], 2 * units, *a.shape[2:])

    def rowwise(t: torch.Tensor, rows: int) -> torch.Tensor:
        # non-tiled layouts: rows on dimension 1 whatever the trailing shape
        return t if gate.layout == "tiles" else t.reshape(t.shape[0], rows, -1)

    words = pair(rowwise(gate.words, gate.n), rowwise(up.words, up.n))
    scales = pair(rowwise(gate.scales, gate.n), rowwise(up.scales, up.n))
    return ExpertWeight(words.contiguous(), scales.contiguous(), gate.global_scale,
                        gate.layout, gate.n, gate.k, 2 * turns * turn, turn, up.global_scale)

