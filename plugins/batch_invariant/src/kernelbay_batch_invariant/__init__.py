"""kernelbay-batch-invariant: kernels whose results do not depend on the batch size."""

__version__ = "0.1.0"
