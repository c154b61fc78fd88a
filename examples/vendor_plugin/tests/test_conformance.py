"""The plugin contract, checked by the kit every plugin runs."""

from kernelbay.testing import PluginConformance


class TestConformance(PluginConformance):
    plugin = "acme"
