"""2-D segments with data's `sync` across their replicas: `broadcast` (each position's gradients
summed on the first replica's device, which alone steps and sends its slices back before the
next forward) and `parameter_server` (each position's gradients summed on the server, which
steps a copy of every position's slices and sends each its own back; spatial's whole weights:
every band of every replica summed on it in one reduce, data's server) in the plan, its memory
and the program."""
from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from placer import api
from placer.cli.main import main
from placer.plan.ir import OpKind

ROOT = Path(__file__).resolve().parents[2]
TENSOR = ROOT / "specs" / "mlp_tensor_data.yaml"  # segment 1: tensor, data 2, on cuda:0..3
CHANNEL = ROOT / "specs" / "cnn_channel_data.yaml"  # segment 0: channel, data 2
SPATIAL = ROOT / "specs" / "cnn_spatial_data.yaml"  # segment 1: spatial, data 2
BROADCAST = "placement.{}.parallel.sync=broadcast"
POSITIONS = {("cuda:0", "cuda:2"): "cuda:0", ("cuda:1", "cuda:3"): "cuda:1"}  # group: the first replica's device


def _ops(plan, k):
    return [op for op in plan.unique_ops() if op.segment == k]


def _validate(spec, *sets):
    return CliRunner().invoke(main, ["validate", str(spec), *[a for s in sets for a in ("--set", s)]])


def test_validate_takes_sync_broadcast_on_each_2d_mode():
    for spec, k in ((TENSOR, 1), (CHANNEL, 0), (SPATIAL, 1)):
        result = _validate(spec, BROADCAST.format(k))
        assert result.exit_code == 0, result.output


def test_each_position_sums_on_its_first_replica_as_much_as_the_all_reduce_moves():
    for spec, k in ((TENSOR, 1), (CHANNEL, 0)):
        summed = {op.devices: op.bytes for op in _ops(api.plan(spec).plan, k)
                  if op.kind == OpKind.ALL_REDUCE and op.attrs.get("replicas")}
        ops = _ops(api.plan(api.load(spec, [BROADCAST.format(k)])).plan, k)
        assert not [op for op in ops if op.kind == OpKind.ALL_REDUCE and op.attrs.get("replicas")]
        for kind, phase, tensor in ((OpKind.REDUCE, "step", "grads"), (OpKind.BROADCAST, "fwd", "params")):
            got = {op.devices: (op.bytes, op.attrs["root"]) for op in ops if op.kind == kind}
            assert {op.phase for op in ops if op.kind == kind} == {phase}
            assert {op.tensor for op in ops if op.kind == kind} == {tensor}
            # one flat message of the position's slices, as all_reduce_slices sends them
            assert got == {g: (summed[g], root) for g, root in POSITIONS.items()}, (spec.name, kind)


def test_only_the_first_replica_steps_and_keeps_optimizer_state():
    adam = "training.optimizer={op: Adam, lr: 0.01}"
    report = api.plan(api.load(TENSOR, [BROADCAST.format(1), adam]))
    steps = {op.devices[0] for op in _ops(report.plan, 1) if op.kind == OpKind.STEP}
    assert steps == {"cuda:0", "cuda:1"}
    mem, allreduce = report.estimate.memory, api.plan(api.load(TENSOR, [adam])).estimate.memory
    assert mem["cuda:2"].optimizer_bytes == mem["cuda:3"].optimizer_bytes == 0  # no stage elsewhere on them
    assert allreduce["cuda:3"].optimizer_bytes == 2 * allreduce["cuda:3"].param_bytes  # Adam's two buffers
    assert mem["cuda:1"].optimizer_bytes == allreduce["cuda:1"].optimizer_bytes > 0


def test_accumulate_sums_once_a_step():
    one = {op.devices: op.bytes for op in _ops(api.plan(api.load(TENSOR, [BROADCAST.format(1)])).plan, 1)
           if op.kind in (OpKind.REDUCE, OpKind.BROADCAST)}
    two = {op.devices: op.bytes for op in _ops(api.plan(api.load(TENSOR, [BROADCAST.format(1), "training.accumulate=2"]))
                                              .plan, 1) if op.kind in (OpKind.REDUCE, OpKind.BROADCAST)}
    assert one == two and len(one) == 2


def test_spatial_sums_its_bands_then_reduces_each_position_on_the_first_replica():
    ops = _ops(api.plan(api.load(SPATIAL, [BROADCAST.format(1)])).plan, 1)
    sums = sorted(op.devices for op in ops if op.kind == OpKind.ALL_REDUCE and op.tensor == "grads")
    assert sums == [("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")]  # the bands of each replica only
    for kind in (OpKind.REDUCE, OpKind.BROADCAST):
        assert {(op.devices, op.attrs["root"]) for op in ops if op.kind == kind} == set(POSITIONS.items())


def test_the_program_broadcasts_before_the_forward_and_reduces_before_the_step():
    text = api.generate(api.load(TENSOR, [BROADCAST.format(1)]))
    flat = "".join(text.split())
    assert "ifrankin(0,1):#thefirstdatareplicaalonekeepstheoptimizeropt1=make_optimizer(seg1.parameters())" in flat
    before, reduce = "broadcast_slices(seg1,dp1,root=dist.get_global_rank(dp1,0))", \
        "reduce_slices(seg1,dp1,root=dist.get_global_rank(dp1,0))"
    assert flat.index(before) < flat.index("#forward,segmentbysegment") < flat.index(reduce)
    assert f"{reduce}ifopt1isnotNone:#thefirstreplica'sranksstepopt1.step()" in flat
    assert "all_reduce_slices(seg1,dp1)" not in flat
    flat = "".join(api.generate(api.load(SPATIAL, [BROADCAST.format(1)])).split())
    assert "broadcast_sync_before_forward(seg1.parameters(),dp1,root=dist.get_global_rank(dp1,0)" in flat
    assert ("all_reduce_grads(seg1.parameters(),g1,bucket_mb=25.0)#thefirstreplicasumsandsteps"
            "broadcast_sync_after_backward(seg1.parameters(),"
            "opt1,dp1,root=dist.get_global_rank(dp1,0)") in flat


def _ps(k, server):
    return [f"placement.{k}.parallel.sync=parameter_server", f"placement.{k}.parallel.server={server}"]


FIVE = ["devices=[cuda:0, cuda:1, cuda:2, cuda:3, cuda:4]", "placement.2.device=cuda:4"]  # a server outside


def test_validate_takes_a_parameter_server_on_each_2d_mode():
    for spec, k in ((TENSOR, 1), (CHANNEL, 0), (SPATIAL, 1)):
        result = _validate(spec, *_ps(k, "cuda:1"))
        assert result.exit_code == 0, result.output
    for spec in (TENSOR, SPATIAL):
        assert _validate(spec, *FIVE, *_ps(1, "cuda:4")).exit_code == 0
    spatial = _validate(SPATIAL, *_ps(1, "cuda:9"))
    assert spatial.exit_code == 1 and "error[P012]" in spatial.output, spatial.output
    unknown = _validate(TENSOR, *_ps(1, "cuda:9"))
    assert unknown.exit_code == 1 and "error[P012]" in unknown.output, unknown.output
    sharded = _validate(TENSOR, *_ps(1, "cuda:0"), "placement.1.parallel.shard=optimizer")
    assert sharded.exit_code == 1 and "error[P025]" in sharded.output, sharded.output
    clipped = _validate(CHANNEL, *_ps(0, "cuda:0"), "training.clip_grad_norm=1.0")
    assert clipped.exit_code == 1 and "error[P092]" in clipped.output, clipped.output


def test_each_position_sums_on_the_server_and_gets_its_slices_back():
    for spec, k, server in ((TENSOR, 1, "cuda:1"), (CHANNEL, 0, "cuda:0")):
        summed = {op.devices: op.bytes for op in _ops(api.plan(spec).plan, k)
                  if op.kind == OpKind.ALL_REDUCE and op.attrs.get("replicas")}
        ops = _ops(api.plan(api.load(spec, _ps(k, server))).plan, k)
        assert not [op for op in ops if op.kind == OpKind.ALL_REDUCE and op.attrs.get("replicas")]
        assert {op.devices[0] for op in ops if op.kind == OpKind.STEP} == {server}
        # per position: its devices and the server, one flat message of the position's slices each way
        want = {tuple(sorted(g + ((server,) if server not in g else ()))): b for g, b in summed.items()}
        for kind, tensor in ((OpKind.REDUCE, "grads"), (OpKind.BROADCAST, "params")):
            got = {tuple(sorted(op.devices)): op.bytes for op in ops if op.kind == kind}
            assert got == want, (spec.name, kind)
            assert {(op.phase, op.tensor, op.attrs["root"]) for op in ops if op.kind == kind} == {
                ("step", tensor, server)}


def test_the_server_holds_and_steps_a_copy_of_every_positions_slices():
    adam = "training.optimizer={op: Adam, lr: 0.01}"
    allreduce = api.plan(api.load(TENSOR, [adam])).estimate.memory
    slices = allreduce["cuda:2"].param_bytes  # one position's (cuda:2 runs segment 1 only)
    outside = api.plan(api.load(TENSOR, [adam, *FIVE, *_ps(1, "cuda:4")])).estimate.memory
    head = 330 * 4  # the classifier's Linear(32, 10), also on cuda:4
    assert outside["cuda:4"].param_bytes == outside["cuda:4"].grad_bytes == head + 2 * slices
    assert outside["cuda:4"].optimizer_bytes == 2 * (head + 2 * slices)  # Adam's two buffers
    assert outside["cuda:2"].optimizer_bytes == outside["cuda:3"].optimizer_bytes == 0
    inside = api.plan(api.load(TENSOR, [adam, *_ps(1, "cuda:3")])).estimate.memory
    assert inside["cuda:3"].param_bytes == 3 * slices  # its own slices and a copy of both positions'
    assert inside["cuda:3"].optimizer_bytes == 2 * 2 * slices and inside["cuda:2"].optimizer_bytes == 0


def test_accumulate_sums_on_the_server_once_a_step():
    def moved(*sets):
        return sorted((op.kind.value, op.devices, op.bytes) for op in _ops(api.plan(api.load(TENSOR, list(sets))).plan, 1)
                      if op.kind in (OpKind.REDUCE, OpKind.BROADCAST))
    assert moved(*_ps(1, "cuda:0")) == moved(*_ps(1, "cuda:0"), "training.accumulate=2")
    assert len(moved(*_ps(1, "cuda:0"))) == 4


def test_the_program_makes_a_slice_server_and_steps_it_after_backward():
    text = api.generate(api.load(TENSOR, [*FIVE, *_ps(1, "cuda:4")]))
    flat = "".join(text.split())
    assert "forranksin[[0,2,4],[1,3,4]]]" in flat  # each position's ranks and the server
    assert "ifTrue" not in flat and "withuncounted():#set-up,not training:eachposition".replace(" ", "") in flat
    assert "srv1=SliceServer(seg1,ps1,[[0,2],[1,3]],server=4,make_optimizer=make_optimizer)opt1=srv1.optimizer" in flat
    assert flat.index("#forward,segmentbysegment") < flat.index("srv1.step()")
    assert "all_reduce_slices(seg1,dp1)" not in flat and "opt1.step()" not in flat
    assert "record_grads_now(seg1.parameters())" in flat  # run --check's first gradients, as the server summed


def test_spatial_sums_every_band_of_every_replica_on_the_server_in_one_reduce():
    """spatial's devices hold the whole weights: no band sums nor position sums, but data's
    parameter server over the group and the server, bucket by bucket."""
    bands = [op.bytes for op in _ops(api.plan(SPATIAL).plan, 1)
             if op.kind == OpKind.ALL_REDUCE and op.devices == ("cuda:0", "cuda:1")]
    assert bands  # the band sum of one replica: the whole weights' bytes, in buckets
    for server, group in (("cuda:1", ("cuda:0", "cuda:1", "cuda:2", "cuda:3")),
                          ("cuda:4", ("cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:4"))):
        ops = _ops(api.plan(api.load(SPATIAL, [*FIVE, *_ps(1, server)])).plan, 1)
        assert not [op for op in ops if op.kind == OpKind.ALL_REDUCE and op.tensor == "grads"]
        assert {op.devices[0] for op in ops if op.kind == OpKind.STEP} == {server}
        for kind, tensor in ((OpKind.REDUCE, "grads"), (OpKind.BROADCAST, "params")):
            mine = [op for op in ops if op.kind == kind]
            assert {(op.devices, op.phase, op.tensor, op.attrs["root"]) for op in mine} == {
                (group, "step", tensor, server)}
            assert sorted(op.bytes for op in mine) == sorted(bands), (server, kind)


def test_a_spatial_server_holds_and_steps_one_whole_copy():
    adam = "training.optimizer={op: Adam, lr: 0.01}"
    allreduce = api.plan(api.load(SPATIAL, [adam])).estimate.memory
    whole = allreduce["cuda:2"].param_bytes  # the features' weights (cuda:2 runs segment 1 only)
    outside = api.plan(api.load(SPATIAL, [adam, *FIVE, *_ps(1, "cuda:4")])).estimate.memory
    head = (1024 * 10 + 10) * 4  # the classifier's Linear(1024, 10), also on cuda:4
    assert outside["cuda:4"].param_bytes == outside["cuda:4"].grad_bytes == head + whole  # not a copy a position
    assert outside["cuda:4"].optimizer_bytes == 2 * (head + whole)
    assert outside["cuda:2"].param_bytes == whole and outside["cuda:2"].optimizer_bytes == 0
    inside = api.plan(api.load(SPATIAL, [adam, *_ps(1, "cuda:3")])).estimate.memory
    assert inside["cuda:3"].param_bytes == whole and inside["cuda:3"].optimizer_bytes == 2 * whole
    assert inside["cuda:2"].optimizer_bytes == 0


def test_the_program_steps_spatial_on_a_server_that_runs_no_forward():
    flat = "".join(api.generate(api.load(SPATIAL, [*FIVE, *_ps(1, "cuda:4")])).split())
    assert "ps1=dist.new_group([0,1,2,3,4]" in flat
    assert "ifrank==4:#theparameterserver:thewholelayers,steppedhere,noforwardseg1=stageelse:seg1=SpatialSplit(" \
        in flat
    assert ("param_server_step(seg1.parameters(),opt1,ps1,server=4,bucket_mb=25.0,buffers=list(seg1.buffers()),"
            "buffers_from=0") in flat
    assert "all_reduce_grads(seg1.parameters(),g1" not in flat and "opt1.step()" not in flat
    inside = "".join(api.generate(api.load(SPATIAL, _ps(1, "cuda:1"))).split())
    assert "param_server_step(seg1.parameters(),opt1,ps1,server=1,bucket_mb=25.0)" in inside
    assert "seg1=stage" not in inside


MODULE = ROOT / "tests" / "models" / "stem_split_data.yaml"  # segment 0: spatial x data on cpu..cpu:3 (StemNet)


def test_a_module_models_spatial_server_outside_runs_no_chain_and_holds_a_segment():
    flat = "".join(api.generate(api.load(MODULE, _ps(0, "cpu:4"))).split())  # cpu:4 runs the body
    assert 'ifrankin(0,1,2,3):#themodel\'sforwardcallsthesplitchainrun_as_chain(model,["conv1","bn1",' in flat
    assert "param_server_step(seg0.parameters(),opt0,ps0,server=4" in flat
    lone = _validate(MODULE, "devices=[cpu, cpu:1, cpu:2, cpu:3, cpu:4, cpu:5]", *_ps(0, "cpu:5"))
    assert "warning[W007]" in lone.output and "parameter server on 'cpu:5', a device that holds no segment" \
        in lone.output, lone.output
    # the channel head's server too (it crashed every rank at set-up), and refused once the model is built
    for k in (0, 2):
        deep = CliRunner().invoke(main, ["validate", "--deep", str(MODULE), "--set",
                                         "devices=[cpu, cpu:1, cpu:2, cpu:3, cpu:4, cpu:5]",
                                         *[a for s in _ps(k, "cpu:5") for a in ("--set", s)]])
        assert deep.exit_code == 1 and "error[P086]" in deep.output and "on 'cpu:5', a device that holds no " \
            "segment" in deep.output, deep.output


def test_parameter_server_sync_without_data_shard_and_clipping_are_refused():
    alone = _validate(TENSOR, BROADCAST.format(1), "placement.1.parallel.data=1")
    assert alone.exit_code == 1 and "error[P033]" in alone.output and "sync 'broadcast'" in alone.output
    sharded = _validate(TENSOR, BROADCAST.format(1), "placement.1.parallel.shard=optimizer")
    assert sharded.exit_code == 1 and "error[P025]" in sharded.output, sharded.output
    clipped = _validate(SPATIAL, BROADCAST.format(1), "training.clip_grad_norm=1.0")
    assert clipped.exit_code == 1 and "error[P092]" in clipped.output, clipped.output
