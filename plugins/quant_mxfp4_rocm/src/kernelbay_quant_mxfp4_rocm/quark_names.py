"""Which linear-module parameter each scale tensor of a Quark checkpoint belongs to.

Quark's exporter (``SAVE_MAP``) writes a quantized linear layer's tensors under the layer's
own prefix, with the names linear methods use: ``weight`` (packed E2M1 uint8 for MXFP4),
``weight_scale`` (E8M0 bytes), ``input_scale`` / ``output_scale`` (static FP8 scales). Where a
checkpoint's name differs from the parameter it fills, it is listed in ``RENAMED_SCALES``:
the FP8 KV-cache export folds ``k_proj.output_scale`` / ``v_proj.output_scale`` into
``self_attn.k_scale`` / ``self_attn.v_scale`` (``preprocess_import_info`` undoes it on
import). Every other tensor whose name says it is a scale or zero point must match one of
these rules; anything left over is an error that lists it, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from kernelbay.errors import CheckpointError

if TYPE_CHECKING:
    from kernelbay.checkpoint.tensors import TensorInfo

__all__ = ["MODULE_SCALES", "RENAMED_SCALES", "is_scale_name", "match_scale_tensors"]

#: Scale tensors stored as ``<module>.<name>`` under the parameter's own name.
MODULE_SCALES: tuple[str, ...] = ("weight_scale", "input_scale", "output_scale")

#: Checkpoint leaf -> (sibling linear module it belongs to, parameter name), for tensors
#: stored under the parent module: ``<attn>.k_scale`` fills ``<attn>.k_proj.output_scale``.
RENAMED_SCALES: dict[str, tuple[str, str]] = {
    "k_scale": ("k_proj", "output_scale"),
    "v_scale": ("v_proj", "output_scale"),
}


def is_scale_name(name: str) -> bool:
    """True for a tensor name whose last component is a scale or a zero point."""
    leaf = name.rsplit(".", 1)[-1]
    return "scale" in leaf or "zero_point" in leaf


def match_scale_tensors(tensors: Mapping[str, TensorInfo],
                        modules: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Map every scale tensor of the checkpoint to ``(linear module, parameter name)``.

    Raises ``CheckpointError`` listing every scale tensor that matches no rule or whose
    module is not one of ``modules``, with the rules it was tried against.
    """
    known = set(modules)
    found: dict[str, tuple[str, str]] = {}
    unmatched: list[str] = []
    for name in sorted(tensors):
        if not is_scale_name(name):
            continue
        parent, _, leaf = name.rpartition(".")
        if leaf in MODULE_SCALES and parent in known:
            found[name] = (parent, leaf)
        elif leaf in RENAMED_SCALES:
            sibling, param = RENAMED_SCALES[leaf]
            owner = f"{parent}.{sibling}" if parent else sibling
            if owner in known:
                found[name] = (owner, param)
            else:
                unmatched.append(name)
        else:
            unmatched.append(name)
    if unmatched:
        shown = ", ".join(repr(n) for n in unmatched[:20])
        more = f" and {len(unmatched) - 20} more" if len(unmatched) > 20 else ""
        raise CheckpointError(tensors[unmatched[0]].file,
                              f"{len(unmatched)} scale tensor(s) match no linear layer "
                              f"parameter: {shown}{more}. Known: <linear module>."
                              f"{{{', '.join(MODULE_SCALES)}}} and "
                              + ", ".join(f"<parent>.{k} -> <parent>.{s}.{p}"
                                          for k, (s, p) in RENAMED_SCALES.items()))
    return found
