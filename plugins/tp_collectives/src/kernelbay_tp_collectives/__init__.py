"""kernelbay-tp-collectives: tensor-parallel collectives over PyTorch symmetric memory."""

__version__ = "0.1.0"
