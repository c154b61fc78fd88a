"""Export the kernelbay demo model with AMD Quark (the ``mxfp4`` template scheme), for
recording ``fixtures/quark_mxfp4_demo.json``. Runs in a scratch environment, not the dev venv:

    python -m venv /tmp/qvenv && /tmp/qvenv/bin/pip install torch==2.13.0 amd-quark==0.13 \\
        "transformers>=4.57,<4.58" "datasets<4.4" accelerate
    /tmp/qvenv/bin/python plugins/quant_mxfp4_rocm/tests/vendor/quark_export.py /tmp/q_mxfp4
    python plugins/quant_mxfp4_rocm/tests/quark_manifest.py /tmp/q_mxfp4 \\
        > plugins/quant_mxfp4_rocm/tests/fixtures/quark_mxfp4_demo.json

transformers 4.57 keeps one ``nn.Linear`` per expert, which Quark quantizes; with
transformers 5.x (fused 3-D experts) Quark 0.13 leaves the experts in bf16. MX weights need
no calibration data (activations are dynamic), so nothing runs through the model.
"""

import os
import sys

import torch
from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "..", "..", "..", "core", "src", "kernelbay", "demo")

model = AutoModelForCausalLM.from_pretrained(SOURCE, dtype=torch.bfloat16).eval()
config = LLMTemplate.get(model.config.model_type).get_config(scheme="mxfp4")
quantizer = ModelQuantizer(config)
model = quantizer.freeze(quantizer.quantize_model(model, None))
with torch.no_grad():
    export_safetensors(model, sys.argv[1])
