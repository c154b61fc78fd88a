"""Record amd-quark's own numbers for the parity tests (``test_quark_parity.py``). Runs in
the scratch environment of ``quark_export.py`` (amd-quark 0.13, torch 2.13, transformers
4.57), not the dev venv:

    /tmp/qvenv/bin/python plugins/quant_mxfp4_rocm/tests/vendor/quark_reference.py \\
        plugins/quant_mxfp4_rocm/tests/fixtures

Writes into that folder:

* ``quark_mx_even.safetensors``: inputs ``x`` (float32 [R, 256]: Gaussian blocks of
  magnitudes 2^-60..2^60 and edge rows) and Quark's dynamic MXFP4 input quantizer (the
  ``mxfp4`` template's, scale_calculation_mode ``even``) applied to them in float32
  (``fq_fp32``; Quark's bf16 path is a GPU kernel, ``qdq_mxfp4``, not run on a CPU);
* ``quark_llama_mxfp4/``: a tiny random Llama (float32) quantized with
  ``LLMTemplate.get("llama").get_config("mxfp4")`` (MXFP4 weights, dynamic MXFP4
  activations, lm_head excluded) and exported with ``export_safetensors``;
* ``quark_llama_mxfp4_logits.safetensors``: ``ids`` and the logits of Quark's fp32
  fake-quantized forward of that model (before export).
"""

import os
import sys

import torch
from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

OUT = sys.argv[1]


def mx_inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(61)
    mag = torch.exp2(torch.randint(-60, 60, (48, 8, 1), generator=g).float())
    x = (torch.randn(48, 8, 32, generator=g) * mag).reshape(48, 256)
    edge = torch.zeros(8, 256)
    edge[1] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 32)  # E2M1 ties
    edge[1, 1::2] *= -1
    edge[2] = torch.tensor([m * 2.0**e for e in range(-16, 16) for m in
                            (1.0, 1.5, 1.75, 1.875, 1.9375, 1.96875, 1.5 * 1.25, 1.7)])
    edge[3] = torch.linspace(-7.0, 7.0, 256)  # amax 7 per block
    edge[4] = torch.full((256,), 2.0**-12)
    edge[4, ::32] = 1.0  # small members next to the block max
    edge[5] = torch.exp2(torch.linspace(-30, 30, 256))
    edge[6] = -edge[5].flip(0)
    edge[7] = torch.tensor([6.0 * 2.0**e for e in range(-32, 32)] * 4)  # max element * 2^e
    return torch.cat([x, edge])


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # non-trivial norms
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    quantizer = ModelQuantizer(LLMTemplate.get("llama").get_config(scheme="mxfp4"))
    model = quantizer.quantize_model(model, None)
    ids = torch.tensor([[1, 17, 42, 255, 3, 99, 128, 7, 64, 200, 11, 5]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
        iq = model.model.layers[0].mlp.gate_proj._input_quantizer
        x = mx_inputs()
        fq32 = iq(x.clone())
    save_file({"x": x, "fq_fp32": fq32.contiguous()},
              os.path.join(OUT, "quark_mx_even.safetensors"))
    save_file({"ids": ids[0].contiguous(), "logits": logits.contiguous()},
              os.path.join(OUT, "quark_llama_mxfp4_logits.safetensors"))
    model = quantizer.freeze(model)
    with torch.no_grad():
        export_safetensors(model, os.path.join(OUT, "quark_llama_mxfp4"))


if __name__ == "__main__":
    main()
