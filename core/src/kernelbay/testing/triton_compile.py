"""Compile a Triton kernel for a CUDA architecture without a GPU (Triton's bundled ptxas), as
a launch would specialize it: for tests that a kernel builds for sm_90 where CI has no GPU
(programmatic-launch PTX, shapes that only a compile specializes). Imports triton when
called."""

from __future__ import annotations

from typing import Any

__all__ = ["compile_for_cuda"]


def compile_for_cuda(kernel: Any, constexprs: dict[str, Any], types: dict[str, str], *,
                     arch: int = 90, default_type: str = "i32", **options: Any) -> Any:
    """``kernel`` (a ``triton.jit`` function) compiled for CUDA ``arch`` with the arguments
    named in ``constexprs`` fixed to their values, the others typed by ``types`` (e.g.
    ``{"x_ptr": "*bf16"}``) or ``default_type``; ``options`` as a launch takes them
    (``num_warps``, ``num_stages``). A Triton without ptxas for this platform skips the
    calling test (``pytest.skip``; where pytest is not installed its ``RuntimeError``
    propagates)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, default_type)
                 for n in names}
    try:
        source = ASTSource(kernel, signature, {(names.index(n),): v for n, v in constexprs.items()})
    except TypeError:  # Triton before 3.3 keys the fixed arguments by name
        source = ASTSource(kernel, signature, dict(constexprs))
    try:
        return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    except RuntimeError as exc:
        if "ptxas" not in str(exc).lower():
            raise
        try:
            import pytest
        except ImportError:
            raise exc from None
        pytest.skip(f"no ptxas here: {exc}")
