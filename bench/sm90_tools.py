"""Shared helpers of the bench scripts that compile Triton kernels for a GPU architecture
without a GPU and inspect the cubin with triton's bundled CUDA tools (``cuobjdump``,
``nvdisasm``): the compile target, registers and spill stack, the SASS listing and the
instructions of its largest loop. Triton is imported only when a helper needs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")
_BRANCH = re.compile(r"\bBRA\b.*`\(\.(L_x_\d+)\)")


def target(arch: int) -> Any:
    """The ``GPUTarget`` of CUDA compute capability ``arch`` (90, 100 ...), warps of 32."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


def tool(name: str) -> str:
    """Path of one of triton's bundled NVIDIA tools (``cuobjdump``, ``nvdisasm``, ``ptxas``)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


@contextmanager
def cubin_file(cubin: bytes) -> Iterator[str]:
    """A temporary file holding ``cubin`` (the tools read files only), removed on exit."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        yield f.name
    finally:
        os.unlink(f.name)


def registers(cubin: bytes) -> str:
    """``REG:n STACK:n`` of the cubin's kernel (``cuobjdump -res-usage``): registers per
    thread and spill stack bytes; ``REG:? STACK:?`` where the listing has no such line."""
    with cubin_file(cubin) as path:
        out = subprocess.run([tool("cuobjdump"), "-res-usage", path], capture_output=True,
                             text=True, check=True).stdout
    line = next((x for x in out.splitlines() if "REG" in x), "REG:? STACK:?").split()
    return f"{line[0]} {line[1]}"


def disassemble(cubin: bytes, line_info: bool = False, check: bool = True) -> str:
    """The cubin's SASS listing (``nvdisasm -c``, with ``-g`` source line comments if
    ``line_info``); with ``check`` false a failing ``nvdisasm`` gives what it printed."""
    flags = ["-c", "-g"] if line_info else ["-c"]
    with cubin_file(cubin) as path:
        return subprocess.run([tool("nvdisasm"), *flags, path], capture_output=True,
                              text=True, check=check).stdout


def opcode(instruction: str) -> str:
    """The opcode with its modifiers (e.g. ``HMMA.16816.F32.BF16``) of one instruction of
    :func:`loop_body`, its guard predicate (``@P0``, ``@!UP1``, ``@!PT`` ...) dropped."""
    return _PREDICATE.sub("", instruction).split()[0]


def loop_body(sass: str) -> list[str]:
    """Instructions (guard predicate and operands kept, address and ``;`` dropped) of the
    largest loop of an ``nvdisasm -c`` listing: from a label to the furthest later branch
    back to it, that branch included; empty if the listing has no loop."""
    labels: dict[str, int] = {}
    pending: list[str] = []
    instrs: list[tuple[int, str]] = []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSTRUCTION.search(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        for name in pending:  # a label stands for the address of the next instruction
            labels[name] = addr
        pending = []
        instrs.append((addr, m.group(2).strip()))
    best = (0, -1)
    for addr, text in instrs:
        branch = _BRANCH.search(text)
        start = labels.get(branch.group(1), addr) if branch else addr
        if start < addr and addr - start > best[1] - best[0]:
            best = (start, addr)
    return [text for addr, text in instrs if best[0] <= addr <= best[1]]
