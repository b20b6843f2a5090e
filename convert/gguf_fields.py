"""Reading GGUF metadata: one accessor for every build step that needs a field."""

from __future__ import annotations


def open_gguf(path):
    from gguf import GGUFReader

    return GGUFReader(str(path))


def gguf_field(reader, key: str, default=None):
    """A metadata value as Python (str, int, float, bool or a list of them), or `default`."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return default
    return field.contents()
