"""The plugin-author kit: pytest fixtures (registered as a pytest plugin) and a conformance
suite each plugin runs over its own classes."""

from kernelbay.testing.conformance import PluginConformance
from kernelbay.testing.loading import load_method
from kernelbay.testing.samples import sample_devices, sample_requests

__all__ = ["PluginConformance", "load_method", "sample_devices", "sample_requests"]
