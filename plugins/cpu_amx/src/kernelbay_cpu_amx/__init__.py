"""kernelbay plugin for x86 CPUs: FP8 E4M3 W8A16 linear kernels (AVX512-BF16, AMX tiles where
present), an unquantized bf16 linear through the same kernels, and the Hugging Face
fine-grained FP8 checkpoint format (``hf-fp8``).

The C++ kernels are compiled on first use and cached per user (``_build``). Discovery imports
only ``kernelbay_cpu_amx.plugin``; nothing it imports loads torch or compiled code.
"""

__version__ = "0.1.1"
