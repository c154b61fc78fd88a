"""Activation ranges for static input scales: run the unquantized source model on a fixed
text with kernelbay's own engine (core backends only) and record, per linear layer, the
largest input magnitude it saw (ModelOpt's ``max`` calibration).

Besides each ``kernelbay.engine.modules.Linear``'s input, two inputs never pass through a
dense linear call here and are recorded where they are made:

* MLA's ``kv_b_proj`` is folded into the attention math (absorbed), so its input is the
  output of its sibling ``kv_a_layernorm`` (``INPUT_FROM_OUTPUT_OF``);
* routed experts run inside one ``MoEMethod.apply_moe`` call, which is wrapped to see its
  ``x`` and ``topk_ids``: gate/up read the routed rows of ``x``; down reads
  ``SiLU(x W_gate^T) * (x W_up^T)`` of each expert's tokens, recomputed from the source
  weights in the activation dtype (as the core's ``TorchMoE`` computes it).

Linear layers called with the same tensor in one forward (q_a_proj and kv_a_proj_with_mqa,
gate_proj and up_proj) are reported as sharing their input, the way ModelOpt's exporter
finds the layers whose scales it unifies. Inputs are seen by wrapping each layer's
``LinearMethod.apply`` (the seam every caller goes through).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["CALIBRATION_FILE", "INPUT_FROM_OUTPUT_OF", "Calibration", "calibrate",
           "calibration_text"]

#: The fixed calibration text shipped with the plugin (ordinary Python source, written for it).
CALIBRATION_FILE = "calibration.txt"
#: Linear leaf -> sibling module whose output is that linear's input, for linear layers the
#: engine folds into other math instead of calling.
INPUT_FROM_OUTPUT_OF: dict[str, str] = {"kv_b_proj": "kv_a_layernorm"}
#: Tokens per calibration window (after the BOS token), as the demo's evaluation uses.
WINDOW = 512

#: ``expert_weights(moe_block, expert, projection)``: the source [N, K] weight of one expert.
ExpertWeights = Callable[[str, int, str], "torch.Tensor"]


@dataclass
class Calibration:
    """What a calibration run saw."""

    #: Linear module -> largest |input| (float, exact: the max of the activation dtype's values).
    amax: dict[str, float] = field(default_factory=dict)
    #: Groups (sorted names) of linear modules that read one input tensor.
    shared_inputs: set[tuple[str, ...]] = field(default_factory=set)
    #: MoE block (``model.layers.3.mlp``) -> (gate/up input amax, down input amax), over all
    #: routed tokens of all experts.
    experts: dict[str, tuple[float, float]] = field(default_factory=dict)

    def note(self, module: str, value: torch.Tensor) -> None:
        """Fold ``max |value|`` into ``module``'s amax."""
        if value.numel() == 0:
            return
        amax = float(value.detach().abs().amax())
        self.amax[module] = max(self.amax.get(module, 0.0), amax)


def calibration_text() -> str:
    """The plugin's fixed calibration text."""
    return (resources.files("kernelbay_quant_nvfp4") / CALIBRATION_FILE).read_text("utf-8")


def _windows(llm: Any, text: str) -> list[list[int]]:
    ids = llm.encode(text)
    bos = (llm.folder.config.model_extra or {}).get("bos_token_id")
    body = ids[1:] if ids and bos is not None and ids[0] == bos else ids
    size = max(1, min(WINDOW, llm.max_model_len - 1))
    head = [bos] if bos is not None else []
    return [head + body[i:i + size] for i in range(0, len(body), size)]


def calibrate(path: str, text: str, expert_weights: ExpertWeights, *,
              progress: bool = False) -> Calibration:
    """Run the checkpoint at ``path`` on ``text`` (in windows of ``WINDOW`` tokens, each after
    BOS) on the CPU with the core's backends, and return the inputs' ranges."""
    import torch
    import torch.nn.functional as F
    from kernelbay.engine import LLM
    from kernelbay.engine.modules import Linear
    from kernelbay.layers.moe import MoEMethod
    from kernelbay.plugins import Registry
    from kernelbay.policy import Policy
    from tqdm import tqdm

    llm = LLM(path, registry=Registry(Policy(plugins=frozenset())), device="cpu",
              max_num_seqs=1, progress=False)
    found = Calibration()
    calls: list[tuple[str, torch.Tensor]] = []  # this forward's (linear, input) pairs
    cache: dict[tuple[str, int], torch.Tensor] = {}

    def w13(block: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        key = (block, expert)
        if key not in cache:
            cache[key] = torch.cat([expert_weights(block, expert, "gate_proj"),
                                    expert_weights(block, expert, "up_proj")]).to(dtype)
        return cache[key]

    def on_linear(name: str, method: Any) -> None:
        # Wrap the method's apply (not a hook on the module): some callers, such as a
        # shared-expert MLP returning a partial sum, call method.apply directly.
        original = method.apply

        def apply(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            calls.append((name, x))
            found.note(name, x)
            return original(layer, x)  # type: ignore[no-any-return]

        method.apply = apply

    def on_output(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            del module, args
            found.note(name, out)
        return hook

    def on_moe(block: str, method: MoEMethod) -> None:
        original = method.apply_moe

        def apply_moe(layer: torch.nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
            ids = topk_ids.long()
            gate_up, down = found.experts.get(block, (0.0, 0.0))
            with torch.no_grad():
                for expert in torch.unique(ids).tolist():
                    tokens = torch.where(ids == expert)[0]
                    xe = x[tokens]
                    both = F.linear(xe, w13(block, expert, x.dtype))
                    inter = both.shape[-1] // 2
                    h = F.silu(both[:, :inter]) * both[:, inter:]
                    gate_up = max(gate_up, float(xe.abs().amax()))
                    down = max(down, float(h.abs().amax()))
            found.experts[block] = (gate_up, down)
            return original(layer, x, topk_ids, topk_weights)

        method.apply_moe = apply_moe  # type: ignore[method-assign]

    handles = []
    for name, module in llm.model.named_modules():
        if isinstance(module, Linear):
            if isinstance(module.method, MoEMethod):
                on_moe(name, module.method)
            else:
                on_linear(name, module.method)
            continue
        parent, _, leaf = name.rpartition(".")
        for linear, source in INPUT_FROM_OUTPUT_OF.items():
            if leaf == source:
                target = f"{parent}.{linear}" if parent else linear
                handles.append(module.register_forward_hook(on_output(target)))
    windows = _windows(llm, text)
    with torch.no_grad():
        for ids in tqdm(windows, desc="calibrating", unit="window", disable=not progress):
            calls.clear()
            llm.logits(ids)
            # Linear.forward hands each method its own flattened view of the input, so the
            # same input is the same storage, shape and strides (all kept alive in calls).
            by_tensor: dict[tuple[Any, ...], list[str]] = {}
            for name, tensor in calls:
                key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
                by_tensor.setdefault(key, []).append(name)
            found.shared_inputs.update(tuple(sorted(set(names)))
                                       for names in by_tensor.values() if len(set(names)) > 1)
    calls.clear()
    for handle in handles:
        handle.remove()
    return found
