"""kernelbay plugin for NVFP4 checkpoints: NVIDIA ModelOpt (``quant_method: "modelopt"``, also
its FP8 and FP8 per-block layers) and llm-compressor's compressed-tensors
``nvfp4-pack-quantized``, with a reference NVFP4 linear method that runs on any device.

Discovery imports only ``kernelbay_quant_nvfp4.plugin``; nothing here imports torch.
"""

__version__ = "0.1.5"
