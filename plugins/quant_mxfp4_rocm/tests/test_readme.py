"""The README's worked example of the scale rules is what the reference computes."""

from __future__ import annotations

import os

from kernelbay_quant_mxfp4_rocm.scale_rules import worked_example

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_scale_rules_example_is_current() -> None:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    start = text.index("<!-- scale-rules-example -->\n") + len("<!-- scale-rules-example -->\n")
    end = text.index("<!-- /scale-rules-example -->")
    assert text[start:end].rstrip("\n").split("\n") == worked_example(), (
        "re-run: python -m kernelbay_quant_mxfp4_rocm.scale_rules")
