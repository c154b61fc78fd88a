"""Export the kernelbay demo model with NVIDIA ModelOpt (NVFP4_DEFAULT_CFG), for recording
``fixtures/modelopt_nvfp4_demo.json``. Runs in a scratch environment, not the dev venv:

    python -m venv /tmp/movenv && /tmp/movenv/bin/pip install torch==2.13.0 \\
        nvidia-modelopt==0.47.0 "transformers>=5.3,<5.15" accelerate requests
    /tmp/movenv/bin/python plugins/quant_nvfp4/tests/vendor/modelopt_export.py /tmp/mo_nvfp4
    python plugins/quant_nvfp4/tests/modelopt_manifest.py /tmp/mo_nvfp4 \\
        > plugins/quant_nvfp4/tests/fixtures/modelopt_nvfp4_demo.json

Calibration is ModelOpt's ``max`` over the plugin's ``calibration.txt`` in the windows the
writer uses (BOS, then 512 bytes). Calibration and export run on the CPU.
"""

import os
import sys

import modelopt.torch.quantization as mtq
import torch
from modelopt.torch.export import export_hf_checkpoint
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "..", "..", "..", "core", "src", "kernelbay", "demo")
TEXT = os.path.join(HERE, "..", "..", "src", "kernelbay_quant_nvfp4", "calibration.txt")
BOS, WINDOW = 256, 512

model = AutoModelForCausalLM.from_pretrained(SOURCE, dtype=torch.bfloat16).eval()
with open(TEXT, encoding="utf-8") as f:
    data = list(f.read().encode("utf-8"))


def forward_loop(m: torch.nn.Module) -> None:
    with torch.no_grad():
        for start in range(0, len(data), WINDOW):
            m(input_ids=torch.tensor([[BOS, *data[start:start + WINDOW]]]))


model = mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)
export_hf_checkpoint(model, export_dir=sys.argv[1])
