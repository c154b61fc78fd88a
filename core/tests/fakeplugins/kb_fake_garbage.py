"""A fake plugin whose hooks return garbage and whose other hook raises."""

from __future__ import annotations

from kernelbay import hookimpl

KERNELBAY_PLUGIN_API = "1.0"


@hookimpl
def kernelbay_linear_methods() -> object:
    return [42, "not a class", dict]


@hookimpl
def kernelbay_attention_backends() -> object:
    raise ValueError("attention hook broke")


@hookimpl
def kernelbay_proposers() -> object:
    return "ngram"
