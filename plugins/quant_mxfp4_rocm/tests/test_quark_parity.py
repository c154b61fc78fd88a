"""Parity with amd-quark's own numbers, recorded by ``vendor/quark_reference.py`` (amd-quark
0.13 on the CPU; the README says how to re-record):

* the reference MX quantizer (``kernelbay.formats.mx``, rule ``even``) and the Triton
  quantizer against Quark's dynamic MXFP4 input quantizer, value for value, on random blocks
  of magnitudes 2^-60..2^60 and edge rows;
* a tiny Llama quantized and exported by Quark (MXFP4 weights, dynamic MXFP4 activations,
  lm_head excluded) loads, plans the MXFP4 methods, and ``LLM.logits`` matches Quark's fp32
  fake-quantized forward to float32 round-off.
"""

from __future__ import annotations

import os

import pytest
import torch
from kernelbay.formats import dequantize_mx, quantize_mx
from safetensors.torch import load_file

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def test_reference_even_rule_matches_quark() -> None:
    rec = load_file(os.path.join(FIXTURES, "quark_mx_even.safetensors"))
    x, want = rec["x"], rec["fq_fp32"]
    got = dequantize_mx(*quantize_mx(x, "e2m1", "even"), "e2m1")
    assert torch.equal(got, want)  # equal values (Quark writes +0 where -0 is kept)
    floor = dequantize_mx(*quantize_mx(x, "e2m1", "floor"), "e2m1")
    assert not torch.equal(floor, want)  # the record tells the rules apart


def test_triton_quantizer_matches_quark() -> None:
    pytest.importorskip("triton")
    from kernelbay_quant_mxfp4_rocm import triton_mx

    rec = load_file(os.path.join(FIXTURES, "quark_mx_even.safetensors"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data, scales = triton_mx.quantize_mx(rec["x"].to(device), "e2m1", "even")
    assert torch.equal(dequantize_mx(data.cpu(), scales.cpu(), "e2m1"), rec["fq_fp32"])


def test_quark_llama_logits_match_quarks_fake_quant_forward() -> None:
    from kernelbay.engine import LLM

    rec = load_file(os.path.join(FIXTURES, "quark_llama_mxfp4_logits.safetensors"))
    llm = LLM(os.path.join(FIXTURES, "quark_llama_mxfp4"), device="cpu", dtype="float32",
              max_num_seqs=1)
    chosen = {d.module: d.chosen for d in llm.plan.linears}
    assert llm.plan.format.chosen == "quark"
    assert chosen.pop("lm_head") == "torch-unquantized"
    assert set(chosen.values()) == {"mxfp4-emulation"}
    assert {d.request.scheme.activation for d in llm.plan.linears  # type: ignore[union-attr]
            if d.module != "lm_head"} == {"mxfp4-dynamic"}
    logits = llm.logits(rec["ids"].tolist()).float()
    want = rec["logits"]
    assert logits.shape == want.shape
    err = (logits - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err
