"""kernelbay-attn-flashmla: MLA attention over compact KV-cache records.

Record descriptors (``records``: bf16, fp8 with fp32 scales, fp8 with E8M0 scales, MXFP8),
their torch codec (``codec``) and the ``mla-reference`` attention backend (``backend``,
math in ``mla``). Importing this package imports no torch.
"""

__version__ = "0.1.4"
