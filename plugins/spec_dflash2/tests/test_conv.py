"""DynamicDepthwiseConv against an explicit per-slot loop, and its block boundary."""

from __future__ import annotations

import pytest
import torch
from kernelbay_spec_dflash2.modules import DynamicDepthwiseConv


def _random_conv(channels: int, block: int, groups: int, seed: int) -> DynamicDepthwiseConv:
    gen = torch.Generator().manual_seed(seed)
    conv = DynamicDepthwiseConv(channels, block, groups)
    with torch.no_grad():
        for p in conv.parameters():       # leave the identity init: every term must matter
            p.copy_(torch.randn(p.shape, generator=gen))
    return conv


def _loop(conv: DynamicDepthwiseConv, x: torch.Tensor) -> torch.Tensor:
    """y_t = k_{t,0} x_t + k_{t,1} x_{t-1}, slot by slot, channel group by channel group."""
    per_group = conv.channels // conv.groups
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            delta = conv.delta.weight @ x[b, t] + conv.delta.bias      # [2G]: tap-major
            first_of_block = t % conv.block_size == 0
            for ch in range(conv.channels):
                g = ch // per_group
                k0 = conv.static[0, ch] + delta[g]
                k1 = conv.static[1, ch] + delta[conv.groups + g]
                prev = 0.0 if first_of_block else x[b, t - 1, ch]
                out[b, t, ch] = k0 * x[b, t, ch] + k1 * prev
    return out


@pytest.mark.parametrize("channels, block, groups, slots", [(8, 4, 2, 12), (6, 3, 3, 3),
                                                            (4, 1, 1, 5), (12, 8, 4, 16)])
def test_conv_matches_explicit_loop(channels: int, block: int, groups: int, slots: int) -> None:
    conv = _random_conv(channels, block, groups, seed=channels * 100 + block)
    x = torch.randn(2, slots, channels, generator=torch.Generator().manual_seed(slots))
    with torch.no_grad():
        torch.testing.assert_close(conv(x), _loop(conv, x), rtol=1e-5, atol=1e-5)


def test_no_tap_crosses_a_block_start() -> None:
    conv = _random_conv(8, 4, 2, seed=7)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, 12, 8, generator=gen)
    y = conv(x)
    # Changing the last slot of block 0 may only change that slot's output.
    x2 = x.clone()
    x2[0, 3] += torch.randn(8, generator=gen) * 100
    y2 = conv(x2)
    changed = (y2 - y).abs().amax(-1)[0] > 0
    assert changed.tolist() == [False, False, False, True] + [False] * 8
    # Changing slot 4 (first of block 1) changes slots 4 and 5, nothing before.
    x3 = x.clone()
    x3[0, 4] += 1.0
    changed = (conv(x3) - y).abs().amax(-1)[0] > 0
    assert changed.tolist() == [False] * 4 + [True, True] + [False] * 6


def test_fresh_conv_is_identity_and_zero_input_gives_zero() -> None:
    conv = DynamicDepthwiseConv(16, 8, 4)
    x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(conv(x), x)
    random_conv = _random_conv(16, 8, 4, seed=1)
    zeros = torch.zeros(2, 16, 16)
    assert torch.equal(random_conv(zeros), zeros)   # delta bias alone never creates signal


def test_kernel_depends_on_content() -> None:
    conv = _random_conv(8, 4, 2, seed=3)
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(1, 4, 8, generator=gen), torch.randn(1, 4, 8, generator=gen)
    assert not torch.allclose(conv.kernel(a), conv.kernel(b))
    # One value per tap and group: channels of a group share the delta.
    taps = conv.kernel(a) - conv.static
    torch.testing.assert_close(taps[..., :4], taps[..., :1].expand_as(taps[..., :4]))
    assert not torch.allclose(taps[..., :4], taps[..., 4:])


def test_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="multiple of groups"):
        DynamicDepthwiseConv(10, 4, 3)
    conv = DynamicDepthwiseConv(8, 4, 2)
    with pytest.raises(ValueError, match=r"block_size=4, got \(1, 6, 8\)"):
        conv(torch.zeros(1, 6, 8))
