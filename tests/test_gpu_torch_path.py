"""The PyTorch path on CUDA equals the CPU path (every family variant); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from conftest import MODEL_VARIANTS

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("variant", sorted(MODEL_VARIANTS))
def test_cuda_matches_cpu(variant):
    build, overrides = MODEL_VARIANTS[variant]
    model = build(**overrides)
    ids = torch.randint(1, 97, (3, 40))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, :9] = 0
    with torch.no_grad():
        cpu = model(ids, attention_mask=mask).logits
        gen_cpu = model.generate(ids[:, :12], attention_mask=mask[:, :12], max_new_tokens=12, do_sample=False)
        model = model.cuda()
        gpu = model(ids.cuda(), attention_mask=mask.cuda()).logits.cpu()
        gen_gpu = model.generate(ids[:, :12].cuda(), attention_mask=mask[:, :12].cuda(), max_new_tokens=12,
                                 do_sample=False).cpu()
    valid = mask.bool()
    torch.testing.assert_close(gpu[valid], cpu[valid], rtol=1e-3, atol=1e-4)
    assert torch.equal(gen_gpu, gen_cpu)


@pytest.mark.parametrize("variant", sorted(MODEL_VARIANTS))
def test_cuda_bf16_training_step(variant):
    build, overrides = MODEL_VARIANTS[variant]
    model = build(**overrides).cuda().train()
    ids = torch.randint(1, 97, (2, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
