"""memo train's optimizer (NOTE [Fused AdamW] in memo/train/loop.py): fused where torch offers it,
the same steps as torch's default AdamW, only trainable parameters."""

from __future__ import annotations

import torch

from memo.train.loop import adamw


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def test_the_fused_step_matches_the_default_one():
    fused_model, plain_model = _model(0), _model(0)
    fused = adamw(fused_model.parameters(), lr=1e-2)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    assert fused.defaults["fused"] is True
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        for model, opt in ((fused_model, fused), (plain_model, plain)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for a, b in zip(fused_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(fused_model[0].weight, _model(0)[0].weight)  # it did train


def test_frozen_parameters_are_left_out_and_meta_parameters_keep_the_default():
    model = _model(0)
    model[0].weight.requires_grad_(False)
    opt = adamw(model.parameters(), lr=1e-3)
    held = [p for group in opt.param_groups for p in group["params"]]
    assert len(held) == 3 and all(p is not model[0].weight for p in held)
    meta = adamw(torch.nn.Linear(4, 4, device="meta").parameters(), lr=1e-3)
    assert not meta.defaults["fused"]
