"""A fake plugin that raises at import."""

raise RuntimeError("fake plugin exploded at import")
