"""2-D segments under `placer run --check`: tensor x data (`parallel: {mode: tensor, data: D}`),
FSDP2 x TP (`shard: full` with it), channel x data and spatial x data (also with ZeRO-1 over
the replicas, `shard: optimizer`) train exactly as one device does (rtol 1e-5, atol 4e-5;
TinyGPT's split blocks under bf16 at bf16's stated tolerance, their sums rounded per rank),
and every device sends what the plan says, whether the 2-D segment sits between one-device
segments (its input arrives through the replicas' first devices; on a module model in lockstep,
whole on every rank, each cutting its replica's rows) or holds the whole model (each replica
takes its rows of the batch and computes the loss on them), on inline layers and on the shipped
TinyGPT's and Hugging Face Llama's blocks."""
from __future__ import annotations

import pytest

from placer.launch.check import BF16_ATOL, BF16_RTOL

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h

ROOT, STEPS = h.ROOT, 3

pytestmark = pytest.mark.distributed

ROUNDED = {"tinygpt_bf16_zero"}  # the runs whose bf16 tensor blocks round their sums apart

FSDP = ["--set", "placement.1.parallel.shard=full"]
CLIP = ["--set", "training.clip_grad_norm=0.05"]  # it bites: the norm is about 0.3
# (spec, --set overrides, workers, what the program calls, bytes slack)
RUNS = [
    ("specs/mlp_tensor_data.yaml", [], 4, "all_reduce_slices(seg1, dp1)", 0),
    ("tests/cases/valid/tensor_data_whole_model/spec.yaml", [], 6, "all_reduce_slices(seg0, dp0)", 0),
    ("tests/models/tinygpt_tensor_data.yaml", [], 4, "all_reduce_slices(seg0, dp0)", 0),
    # ... under bf16 with ZeRO-1 over the replicas: each replica's row sums cross in bfloat16
    ("tests/models/tinygpt_tensor_data.yaml", ["--set", "training.precision=bf16", "--set",
                                              "placement.0.parallel.shard=optimizer"], 4,
     "ZeroSlices(seg0.parameters(), dp0", 0),
    ("specs/mlp_tensor_data.yaml", FSDP, 4, 'fully_shard_segment(stage, mesh1["dp"]', 0),
    # FSDP2 pads a parameter's dim 0 to a multiple of the replicas (TinyGPT's pos is [1, seq, d]);
    # the plan counts unpadded halves
    ("tests/models/tinygpt_fsdp_tp.yaml", [], 4, 'fully_shard_segment(stage, mesh0["dp"]', 0.02),
    ("tests/models/hf_llama_fsdp_tp.yaml", [], 4, 'fully_shard_segment(stage, mesh0["dp"]', 0),
    ("specs/cnn_channel_data.yaml", [], 4, "all_reduce_slices(seg0, dp0)", 0),  # channel x data: Conv channels
    # ... and spatial x data with ZeRO-1 over the replicas: each position steps 1/2 of its slices (or of
    # its whole weights) and broadcasts them; SGD with momentum keeps a state the halves must split right
    ("specs/cnn_channel_data.yaml", ["--set", "placement.0.parallel.shard=optimizer"], 4,
     "ZeroSlices(seg0.parameters(), dp0", 0),
    ("specs/cnn_spatial_data.yaml", ["--set", "placement.1.parallel.shard=optimizer"], 4,
     "ZeroSlices(seg1.parameters(), dp1", 0),
    # ... and FSDP2 over the replicas: each channel slice sharded over the ranks holding it, a unit per layer
    ("specs/cnn_channel_data.yaml", ["--set", "placement.0.parallel.shard=full"], 4,
     "fully_shard_segment(seg0, dp0, device.type)", 0),
    # ... and spatial's whole weights: the bands then sum their shards of the gradients
    ("specs/cnn_spatial_data.yaml", ["--set", "placement.1.parallel.shard=full"], 4,
     "fully_shard_segment(seg1, dp1, device.type)", 0),
    # the global norm counts each slice once: on the first replica, or each (dp, tp) piece under FSDP2 x TP
    ("specs/mlp_tensor_data.yaml", CLIP, 4, "if rank in (0, 1):  # counted on the first data replica", 0),
    ("specs/mlp_tensor_data.yaml", FSDP + CLIP, 4, "norm_share_2d(seg1, tp_first=rank in (0, 2))", 0),
    # two micro-steps a step (the replicas sum once, after the second) and the segment recomputed in backward
    ("specs/mlp_tensor_data.yaml", ["--set", "training.accumulate=2", "--set", "placement.1.recompute=true"], 4,
     "torch.utils.checkpoint.checkpoint(seg1", 0),
    # spatial x data between one-device segments (bands enter and leave through each replica's first rank)
    ("specs/cnn_spatial_data.yaml", [], 4, "all_reduce_grads(seg1.parameters(), dp1", 0),
    # ... with the training options at once: bf16, 2 micro-steps, the segment recomputed, a clip that
    # bites (the norm is about 3): bands and replicas sum once a step, the norm counts each weight once
    ("specs/cnn_spatial_data.yaml", ["--set", "training.precision=bf16", "--set", "training.accumulate=2", "--set",
                                     "placement.1.recompute=true", "--set", "training.clip_grad_norm=0.05"], 4,
     "torch.utils.checkpoint.checkpoint(", 0),
    # ... and as the whole model: each rank takes its band of its replica's rows; the bands meet for the loss
    ("specs/cnn_spatial_dense.yaml", ["--set", "devices=[cuda:0, cuda:1, cuda:2, cuda:3]", "--set",
                                      "placement.0.devices=[cuda:0, cuda:1, cuda:2, cuda:3]", "--set",
                                      "placement.0.parallel.data=2"], 4, "replica_slice(x, [[0, 1], [2, 3]], rank),", 0),
    # sync broadcast: each position's gradients summed on the first replica's device, which alone steps
    # (Adam: a step on the others' half sums, or a stale copy not overwritten, would differ) and sends its slices back
    ("specs/mlp_tensor_data.yaml", ["--set", "placement.1.parallel.sync=broadcast", "--set",
                                    "training.optimizer={op: Adam, lr: 0.01}"], 4,
     "reduce_slices(seg1, dp1, root=dist.get_global_rank(dp1, 0))", 0),
    # ... channel x data's Conv channel slices, over two micro-steps a step (summed once, after the second)
    ("specs/cnn_channel_data.yaml", ["--set", "placement.0.parallel.sync=broadcast", "--set", "training.accumulate=2"],
     4, "broadcast_slices(seg0, dp0, root=dist.get_global_rank(dp0, 0))", 0),
    # sync parameter_server: each position's gradients summed on a server outside the group (a fifth
    # device, also running the classifier), which alone steps (Adam) a copy of every position's slices
    ("specs/mlp_tensor_data.yaml", ["--set", "devices=[cuda:0, cuda:1, cuda:2, cuda:3, cuda:4]", "--set",
                                    "placement.2.device=cuda:4", "--set", "placement.1.parallel.sync=parameter_server",
                                    "--set", "placement.1.parallel.server=cuda:4", "--set",
                                    "training.optimizer={op: Adam, lr: 0.01}"], 5, "srv1.step()", 0),
    # ... channel x data's Conv slices on a server in the group (it sums its own position's, and
    # copies the other's), over two micro-steps a step
    ("specs/cnn_channel_data.yaml", ["--set", "placement.0.parallel.sync=parameter_server", "--set",
                                     "placement.0.parallel.server=cuda:1", "--set", "training.accumulate=2"], 4,
     "SliceServer(seg0, ps0, [[0, 2], [1, 3]], server=1", 0),
    # ... TinyGPT's blocks (a module model in lockstep) on a server in the group
    ("tests/models/tinygpt_tensor_data.yaml", ["--set", "placement.0.parallel.sync=parameter_server", "--set",
                                              "placement.0.parallel.server=cpu:1"], 4, "srv0.step()", 0),
    # ... spatial x data's whole weights on a server outside the group (a fifth device, also running the
    # classifier): one reduce sums every band of every replica onto it, it alone steps (Adam), sends them back
    ("specs/cnn_spatial_data.yaml", ["--set", "devices=[cuda:0, cuda:1, cuda:2, cuda:3, cuda:4]", "--set",
                                     "placement.2.device=cuda:4", "--set", "placement.1.parallel.sync=parameter_server",
                                     "--set", "placement.1.parallel.server=cuda:4", "--set",
                                     "training.optimizer={op: Adam, lr: 0.01}"], 5,
     "seg1 = stage", 0),
    # ... TinyGPT's and Llama's blocks tensor x data beside one-device segments (lockstep): each rank
    # cuts its replica's rows of the hidden state as it arrives, the replicas' outputs gathered by rows
    ("tests/models/tinygpt_tensor_data_beside.yaml", [], 5, 'replica_rows_around(\n            model,\n            [("embed", 0)]', 0),
    # (Llama's under 1F1B: per micro-batch, the rotary cos / sin cross whole, not cut)
    ("tests/models/hf_llama_tensor_data_beside.yaml", ["--set", "pipeline={microbatches: 3, schedule: 1f1b}", "--set",
                                                      "training.batch_size=6", "--set",
                                                      "devices=[cpu, cpu:1, cpu:2, cpu:3, cpu:4, cpu:5]", "--set",
                                                      "placement.2.device=cpu:5"], 6,
     "crossing.backward_own(loss, crossed)", 0),
    # ... TinyGPT's embedding and blocks as the first segment: each rank cuts its replica's rows of the
    # batch (the input ids) as the model's forward begins, so the parent's `+ pos` runs on them too
    ("tests/models/tinygpt_tensor_data_first.yaml", [], 5, 'replica_rows_around(\n            model,\n            [("", 0)]', 0),
    # ... and FSDP2 x TP there (TinyGPT's last block): tensor_parallelize_blocks over tp, then a unit per
    # placed layer over dp, which the model's forward calls (the rows cut and gathered as above)
    ("tests/models/tinygpt_fsdp_tp_beside.yaml", [], 5, 'fully_shard_layers(stage, ["blocks.1"], mesh1["dp"]', 0),
    # (Llama's decoder layers under 1F1B: each unit gathered and resharded per micro-batch)
    ("tests/models/hf_llama_tensor_data_beside.yaml", [*FSDP, "--set", "pipeline={microbatches: 3, schedule: 1f1b}",
                                                      "--set", "training.batch_size=6", "--set",
                                                      "devices=[cpu, cpu:1, cpu:2, cpu:3, cpu:4, cpu:5]", "--set",
                                                      "placement.2.device=cpu:5"], 6,
     'fully_shard_layers(\n            stage, ["model.layers.0", "model.layers.1"], mesh1["dp"]', 0),
]


@pytest.mark.parametrize("spec,sets,workers,call,slack", RUNS,
                         ids=["mlp", "whole_model", "tinygpt", "tinygpt_bf16_zero", "mlp_fsdp", "tinygpt_fsdp", "llama_fsdp",
                              "cnn_channel", "cnn_channel_zero", "cnn_spatial_zero", "cnn_channel_fsdp", "cnn_spatial_fsdp",
                              "mlp_clip", "mlp_fsdp_clip", "mlp_accumulate_recompute", "cnn_spatial",
                              "cnn_spatial_options", "spatial_whole_model", "mlp_broadcast",
                              "cnn_channel_broadcast_accumulate", "mlp_parameter_server_outside",
                              "cnn_channel_parameter_server_accumulate", "tinygpt_parameter_server",
                              "cnn_spatial_parameter_server_outside", "tinygpt_beside", "llama_beside_1f1b",
                              "tinygpt_first", "tinygpt_fsdp_tp_beside", "llama_fsdp_tp_beside_1f1b"])
def test_2d_segment_matches_one_device_and_sends_what_the_plan_says(spec, sets, workers, call, slack, tmp_path,
                                                                    request):
    # autocast rounds each rank's partial row sum to bfloat16 where one device rounds the whole
    # sum: a split block under bf16 matches at the tolerance run --check states for bf16
    tol = dict(rtol=BF16_RTOL, atol=BF16_ATOL) if request.node.callspec.id in ROUNDED else {}
    program, _, metrics, _ = h.checked_run(ROOT / spec, tmp_path / "run", "--steps", str(STEPS), *sets, min_params=1,
                                           **tol)
    assert metrics["world_size"] == workers and len(metrics["losses"]) == STEPS
    assert call in program  # the replicas are combined (summed, or sharded by FSDP2), not left to train apart
    # each first-step gradient gathered whole from its tensor / channel slices (or FSDP2 x TP's (dp, tp) pieces)
    h.assert_every_gradient_compared(tmp_path / "run")
    h.assert_sends_what_the_plan_says(spec, ROOT / spec, metrics, sets[1::2], slack=slack)
