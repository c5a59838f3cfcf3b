"""CPU SyncBatchNorm (runtime/syncbn.py) under autocast's bfloat16: it normalizes in float32 and
gives a bfloat16 output, as BatchNorm does on one device, so what follows rounds alike (a ResNet's
skip connection adds the stem's output as it is)."""
import torch
import torch.distributed as dist
import torch.nn as nn

from placer.codegen.runtime.syncbn import convert_sync_batchnorm_cpu


def test_sync_batchnorm_under_bf16_autocast_equals_batchnorm(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        bn = nn.BatchNorm2d(8)
        nn.init.uniform_(bn.weight), nn.init.uniform_(bn.bias)
        sync = convert_sync_batchnorm_cpu(nn.Sequential(nn.BatchNorm2d(8)))[0]
        sync.load_state_dict(bn.state_dict())
        x = torch.randn(4, 8, 6, 6).bfloat16()
        weights = torch.linspace(-1, 1, x.numel()).view_as(x)
        outs = []
        for module in (bn, sync):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = module(x)
            (y.float() * weights).sum().backward()
            outs.append(y)
        assert outs[1].dtype == outs[0].dtype == torch.bfloat16
        assert torch.equal(outs[1], outs[0])
        torch.testing.assert_close(sync.weight.grad, bn.weight.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sync.bias.grad, bn.bias.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sync.running_var, bn.running_var)
    finally:
        dist.destroy_process_group()
