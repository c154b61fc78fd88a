"""Loading one method's tensors the way the engine's loader does, for unit tests of a single
layer (no checkpoint folder, no model)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kernelbay.layers.linear import LinearMethod

__all__ = ["load_method"]


def load_method(method: LinearMethod, tensors: Mapping[str, torch.Tensor], *,
                exact_dtype: bool = True) -> torch.nn.Module:
    """A layer holding ``method``'s parameters loaded from ``tensors`` (canonical names), as
    ``kernelbay.engine`` loads them: parameters created by the method; an optional tensor that
    is absent leaves no parameter; under tensor parallel a whole tensor with a ``shard_dim`` is
    cut to this rank's shard (one already of the shard's size is taken as it is); shape (and,
    with ``exact_dtype``, dtype) checked; then the method's post-load step.

    Raises ``AssertionError`` naming the tensor when a required one is missing, an unknown
    one is given, or a shape or dtype does not match.
    """
    import torch

    layer = torch.nn.Module()
    method.create_weights(layer)
    specs = method.tensor_specs()
    unknown = sorted(set(tensors) - set(specs))
    assert not unknown, f"tensors {unknown} are not among the method's {sorted(specs)}"
    r = method.request
    for name, spec in specs.items():
        if name not in tensors:
            assert not spec.required, f"required tensor {name!r} is missing"
            del layer._parameters[name]
            continue
        value = tensors[name]
        dim = spec.shard_dim
        if dim is not None and r.tp_size > 1 and value.shape[dim] != spec.shape[dim]:
            value = value.narrow(dim, r.tp_rank * spec.shape[dim], spec.shape[dim])
        assert tuple(value.shape) == spec.shape, (name, tuple(value.shape), spec.shape)
        if exact_dtype:
            assert str(value.dtype) == f"torch.{spec.dtype}", (name, value.dtype, spec.dtype)
        getattr(layer, name).data.copy_(value)
    method.process_weights_after_loading(layer)
    return layer
