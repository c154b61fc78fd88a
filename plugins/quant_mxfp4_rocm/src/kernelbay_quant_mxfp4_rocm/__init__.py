"""kernelbay plugin for AMD Quark checkpoints (``quant_method: "quark"``) with OCP MXFP4
weights, and an MX linear method that runs on any device (Triton kernels for ROCm gfx942 /
gfx950 come next).

Discovery imports only ``kernelbay_quant_mxfp4_rocm.plugin``; nothing here imports torch.
"""

__version__ = "0.1.6"
