"""Version of the core distribution and of the plugin API it implements."""

__version__ = "0.4.13"

#: The plugin API this core implements, as "MAJOR.MINOR". A plugin that targets the same
#: major and a minor no newer than this one is compatible.
PLUGIN_API_VERSION = "1.0"
