"""acme-kernels: an example third-party kernelbay plugin (one linear method)."""

__version__ = "0.1.0"
