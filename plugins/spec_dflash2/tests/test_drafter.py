"""DFlash2Drafter: shapes, masking, conditioning, and the safetensors + JSON round trip."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from kernelbay_spec_dflash2.config import DFlash2Config, read_drafter_config
from kernelbay_spec_dflash2.drafter import DFlash2Drafter, load_drafter, save_drafter

CONFIG = DFlash2Config(target_model_type="llama", target_hidden_size=24, vocab_size=50,
                       target_layer_ids=(1, 3, 4), hidden_size=32, num_layers=2, num_heads=4,
                       intermediate_size=48, block_size=5, num_candidates=6, pair_rank=3,
                       conv_groups=4, context_window=7)


def _randomised(config: DFlash2Config, seed: int) -> DFlash2Drafter:
    torch.manual_seed(seed)
    model = DFlash2Drafter(config)
    with torch.no_grad():   # leave the identity/zero inits so every path carries signal
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def test_forward_shapes_and_draft() -> None:
    model = _randomised(CONFIG, 0)
    gen = torch.Generator().manual_seed(1)
    context = torch.randn(3, 7, 3 * 24, generator=gen)
    anchor = torch.tensor([1, 2, 49])
    logits = model(anchor, context)
    assert logits.shape == (3, 5, 50) and torch.isfinite(logits).all()
    out = model.draft(anchor, context, num_tokens=4)
    assert out.tokens.shape == (3, 4) and out.candidate_ids.shape == (3, 4, 6)
    assert out.candidate_probs.shape == (3, 4, 6)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[1, block_size=5\], got 6"):
        model.draft(anchor, context, num_tokens=6)
    with pytest.raises(ValueError, match=r"expected context \[3, L <= 7, 72\]"):
        model(anchor, torch.randn(3, 8, 72))


def test_padding_is_invisible_and_context_matters() -> None:
    model = _randomised(CONFIG, 2)
    gen = torch.Generator().manual_seed(3)
    short = torch.randn(1, 3, 72, generator=gen)
    anchor = torch.tensor([7])
    padded = torch.cat([torch.randn(1, 4, 72, generator=gen) * 50, short], dim=1)
    mask = torch.tensor([[False] * 4 + [True] * 3])
    # Masked-out rows change nothing; positions count from the anchor, so right-aligned
    # padding keeps every real row's position.
    torch.testing.assert_close(model(anchor, padded, mask), model(anchor, short),
                               rtol=1e-5, atol=1e-5)
    other = short.clone()
    other[0, 0] += 1.0
    assert not torch.allclose(model(anchor, other), model(anchor, short))
    assert not torch.allclose(model(torch.tensor([8]), short), model(anchor, short))


def test_batch_rows_are_independent() -> None:
    model = _randomised(CONFIG, 4)
    gen = torch.Generator().manual_seed(5)
    context = torch.randn(4, 6, 72, generator=gen)
    anchor = torch.randint(0, 50, (4,), generator=gen)
    full = model(anchor, context)
    for b in range(4):
        torch.testing.assert_close(full[b:b + 1], model(anchor[b:b + 1], context[b:b + 1]),
                                   rtol=1e-5, atol=1e-5)


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = _randomised(CONFIG, 6)
    folder = save_drafter(model, str(tmp_path / "drafter"))
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    assert read_drafter_config(folder) == CONFIG
    loaded = load_drafter(folder)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    gen = torch.Generator().manual_seed(7)
    context, anchor = torch.randn(2, 5, 72, generator=gen), torch.tensor([3, 4])
    assert torch.equal(loaded(anchor, context), model(anchor, context))
    data = json.loads((tmp_path / "drafter" / "config.json").read_text(encoding="utf-8"))
    assert data["model_type"] == "dflash2" and data["target_layer_ids"] == [1, 3, 4]


def test_load_rejects_mismatched_weights(tmp_path: Path) -> None:
    folder = save_drafter(_randomised(CONFIG, 8), str(tmp_path / "d"))
    bigger = DFlash2Config(**{**CONFIG.__dict__, "hidden_size": 64})
    (tmp_path / "d" / "config.json").write_text(bigger.to_json())
    with pytest.raises(ValueError, match="shape mismatch"):
        load_drafter(folder)
    deeper = DFlash2Config(**{**CONFIG.__dict__, "num_layers": 3})
    (tmp_path / "d" / "config.json").write_text(deeper.to_json())
    with pytest.raises(ValueError, match=r"missing \['layers.2"):
        load_drafter(folder)


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 30}, "hidden_size=30 is not a multiple of num_heads=4"),
    ({"num_candidates": 51}, "num_candidates=51 exceeds vocab_size=50"),
    ({"block_size": 0}, "'block_size': 0"),
    ({"target_layer_ids": ()}, "at least one target layer"),
])
def test_config_validation(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DFlash2Config(**{**CONFIG.__dict__, **change})


def test_config_json_rejects_unknown_keys() -> None:
    data = CONFIG.to_dict()
    assert DFlash2Config.from_dict(data) == CONFIG
    with pytest.raises(ValueError, match=r"unknown DFlash2 config keys \['hiden_size'\]"):
        DFlash2Config.from_dict({**data, "hiden_size": 3})
    with pytest.raises(ValueError, match="model_type is 'llama'"):
        DFlash2Config.from_dict({**data, "model_type": "llama"})
