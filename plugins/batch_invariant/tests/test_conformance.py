"""The core's plugin conformance suite, run over this plugin's classes."""

from __future__ import annotations

from kernelbay.testing import PluginConformance


class TestConformance(PluginConformance):
    """Contract checks for the ``batch_invariant`` plugin."""

    plugin = "batch_invariant"
