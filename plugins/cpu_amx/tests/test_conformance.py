"""The core's plugin conformance suite, run over this plugin's classes."""

from kernelbay.testing import PluginConformance


class TestConformance(PluginConformance):
    """Discovery, API version, class contract, verdicts, and import hygiene."""

    plugin = "cpu_amx"
