"""The placement graph: DOT text for hand-built plans, rendered by graphviz."""
from __future__ import annotations

import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest

from placer.diagnostics import PlanError
from placer.model.graph import LayerInfo, ModelGraph
from placer.plan.ir import Op, OpKind, PlacedSegment, Plan, union
from placer.render.dot import per_device_shapes, placement_dot, write_diagram

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz not installed")


def seg(index, layers, devices, mode="none", stage=None, name=None, **options):
    return PlacedSegment(index=index, name=name or f"s{index}", layers=tuple(layers), devices=tuple(devices),
                         mode=mode, options=options, stage=stage)


def plan_of(name, devices, segments, ops, **kw):
    table: dict[str, list] = {d: [] for d in devices}
    for op in ops:  # every op sits in the list of each device taking part, as lowering puts it
        for d in dict.fromkeys(op.devices):
            table[d].append(op)
    return Plan(name=name, devices=tuple(devices), segments=tuple(segments),
                ops={d: tuple(v) for d, v in table.items()}, **kw)


def compute(dev, s, phase="fwd", mb=None):
    return Op(kind=OpKind.COMPUTE, devices=(dev,), segment=s, phase=phase, microbatch=mb)


def move(kind, src, dst, s, phase="fwd", **kw):
    """A transfer or pipeline send from devices `src` to `dst` (as lowering writes them)."""
    tensor = "act" if phase == "fwd" else "grad"
    return Op(kind=kind, devices=union(src, dst), src=tuple(src), dst=tuple(dst), segment=s, phase=phase,
              tensor=tensor, **kw)


def copies_plan():
    """cpu -> cuda:0 -> cuda:1 (the last copy routed through the host)."""
    segs = [seg(0, ["fc1", "act1"], ["cpu"]), seg(1, ["block.0", "block.1"], ["cuda:0"]),
            seg(2, ["head"], ["cuda:1"], name='he"ad\\seg')]
    ops = [compute("cpu", 0),
           move(OpKind.COPY, ["cpu"], ["cuda:0"], 1, bytes=131072, route="direct"),
           compute("cuda:0", 1),
           move(OpKind.COPY, ["cuda:0"], ["cuda:1"], 2, bytes=131072, route="via_host"),
           compute("cuda:1", 2), compute("cuda:1", 2, "bwd"),
           move(OpKind.COPY, ["cuda:1"], ["cuda:0"], 2, "bwd", bytes=131072, route="via_host"),
           compute("cuda:0", 1, "bwd"),
           move(OpKind.COPY, ["cuda:0"], ["cpu"], 1, "bwd", bytes=131072, route="direct")]
    return plan_of("copies", ["cpu", "cuda:0", "cuda:1"], segs, ops, batch_size=64)


def data_plan(sync="allreduce"):
    """cpu, then a data group of two GPUs (bucketed all-reduce or a parameter server), then back to cpu."""
    group = ("cuda:0", "cuda:1")
    opts = dict(sync=sync, bucket_mb=25) if sync == "allreduce" else dict(sync=sync, server="cpu")
    segs = [seg(0, ["fc1"], ["cpu"]), seg(1, ["block.0", "block.1"], group, "data", **opts),
            seg(2, ["head"], ["cpu"])]
    if sync == "allreduce":
        sync_ops = [Op(kind=OpKind.ALL_REDUCE, devices=group, segment=1, phase="bwd", tensor="grads",
                       bytes=1 << 20, attrs={"bucket": b, "layers": layers})
                    for b, layers in enumerate(["block.1", "block.0"])]
    else:
        sync_ops = [Op(kind=OpKind.REDUCE, devices=group + ("cpu",), segment=1, phase="bwd", tensor="grads",
                       bytes=1 << 20, attrs={"root": "cpu"}),
                    Op(kind=OpKind.BROADCAST, devices=("cpu",) + group, segment=1, phase="step", tensor="params",
                       bytes=1 << 20, attrs={"root": "cpu"})]
    ops = [compute("cpu", 0),
           move(OpKind.SPLIT, ["cpu"], group, 1, bytes=65536, dst_dim=0),
           *[compute(d, 1) for d in group],
           move(OpKind.MERGE, group, ["cpu"], 2, bytes=4096, src_dim=0),
           compute("cpu", 2), compute("cpu", 2, "bwd"),
           move(OpKind.SPLIT, ["cpu"], group, 2, "bwd", bytes=4096, dst_dim=0),
           *sync_ops,
           Op(kind=OpKind.STEP, devices=("cpu",), segment=0, phase="step")]
    return plan_of("data", ["cpu", "cuda:0", "cuda:1"], segs, ops, batch_size=64)


def resplit_plan():
    """A data group hands its activation to a channel group on other devices."""
    a, b = ("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")
    segs = [seg(0, ["fc1"], a, "data"), seg(1, ["fc2"], b, "channel", axis=1)]
    ops = [move(OpKind.RESPLIT, a, b, 1, bytes=8192, src_dim=0, dst_dim=None)]
    return plan_of("resplit", list(a + b), segs, ops, batch_size=8)


def pipeline_plan(m=4):
    """Four stages interleaved on two GPUs, one send/recv pair per micro-batch and boundary."""
    devs = ["cuda:0", "cuda:1"]
    segs = [seg(i, [f"block.{i}"], [devs[i % 2]], stage=i) for i in range(4)]
    ops = []
    for i in range(1, 4):
        for mb in range(m):
            a, b = devs[(i - 1) % 2], devs[i % 2]
            ops.append(move(OpKind.SEND, [a], [b], i, bytes=8192, microbatch=mb))
            ops.append(move(OpKind.RECV, [a], [b], i, bytes=8192, microbatch=mb))
            ops.append(move(OpKind.SEND, [b], [a], i, "bwd", bytes=8192, microbatch=mb))
            ops.append(move(OpKind.RECV, [b], [a], i, "bwd", bytes=8192, microbatch=mb))
    return plan_of("pipe", devs, segs, ops, microbatches=m, schedule="interleaved_1f1b", batch_size=32)


def small_graph():
    names = ["fc1", "act1", "block.0", "block.1", "head"]
    layers = [LayerInfo(name=n, op="ReLU" if n == "act1" else "Linear", params=0 if n == "act1" else 1000 + i,
                        param_bytes=4000, buffer_bytes=0, in_shape=(64, 16), out_shape=(64, 16), flops=100)
              for i, n in enumerate(names)]
    return ModelGraph(layers=tuple(layers), batch_size=64, input_shape=(64, 16), input_dtype="float32")


def _edges(src: str) -> set[tuple[str, str]]:
    return set(re.findall(r"^\s*(\w+) -> (\w+)", src, re.M))


def _labels(src: str) -> dict[str, str]:
    return dict(re.findall(r"^\s*(\w+) \[.*?label=(\".*?(?<!\\)\")\];$", src, re.M))


def test_copies_are_nodes_on_the_crossing_edges():
    src = placement_dot(copies_plan(), small_graph())
    e, labels = _edges(src), _labels(src)
    # a segment is entered through its header (its devices), then its layers in order
    assert {("input", "s0_h"), ("s0_h", "s0_l0"), ("s0_l0", "s0_l1"), ("s0_l1", "t1_0"), ("t1_0", "s1_h"),
            ("s1_l1", "t2_0"), ("t2_0", "s2_h"), ("s2_l0", "output")} <= e
    assert ("s0_l1", "s1_h") not in e  # the crossing goes through the copy node
    assert "cpu -> cuda:0 (direct)" in labels["t1_0"] and "fwd 128.0 KiB, bwd 128.0 KiB" in labels["t1_0"]
    # the backward gradient copy folds into the forward node; via_host shows the hop through the host
    assert "cuda:0 -> cpu -> cuda:1 (via_host)" in labels["t2_0"] and "bwd 128.0 KiB" in labels["t2_0"]
    assert src.count("shape=cds") == 2
    assert "Linear · 1,000 params" in labels["s0_l0"] and "-> [64, 16]" in labels["s0_l0"]
    assert "of [" not in src  # one device holds the whole tensor: no per-device part to tell


def test_labels_escape_quotes_and_backslashes():
    src = placement_dot(copies_plan())
    assert "<B>segment 2 · he&quot;ad\\seg</B>" in src
    assert src == placement_dot(copies_plan())  # deterministic


def test_data_group_split_merge_and_all_reduce_in_cluster():
    src = placement_dot(data_plan(), estimate={"cuda:0": 3 << 30, "cuda:1": 3 << 30, "cpu": 1 << 20})
    labels = _labels(src)
    assert "shape=trapezium" in src and "shape=invtrapezium" in src
    assert labels["t1_0"] == '"split act (dim 0)\\ncpu -> cuda:0, cuda:1\\nfwd 64.0 KiB"'
    # the backward split of the gradient folds into the forward merge between the same devices
    assert labels["t2_0"] == '"merge act (dim 0)\\ncuda:0, cuda:1 -> cpu\\nfwd 4.0 KiB, bwd 4.0 KiB"'
    # the two all-reduce buckets are one node inside the data segment's cluster, inside the group's cluster
    # the two all-reduce buckets are one node inside the data segment's box
    cluster = src[src.index("subgraph cluster_s1"):src.index("subgraph cluster_s2")]
    assert "s1_c0 [shape=hexagon" in cluster and "s1_c1" not in src
    assert labels["s1_c0"] == '"all-reduce grads\\ncuda:0, cuda:1\\n2.0 MiB in 2 ops"'
    assert "s1_l1 -> s1_c0 [style=dashed" in cluster  # hangs off the last layer its buckets cover
    assert "{rank=same; s1_l1; s1_c0;}" in cluster  # beside it, not on a rank of its own
    # the header shows each replica with its memory, and the mode
    assert ">cuda:0<BR/><FONT POINT-SIZE=\"9\">3.0 GiB</FONT></TD>" in cluster
    assert ">cuda:1<BR/>" in cluster and "data x2 (sync allreduce)" in cluster
    assert "cpu<BR/><FONT POINT-SIZE=\"9\">1.0 MiB" in src[src.index("subgraph cluster_s0"):src.index("subgraph cluster_s1")]


def test_parameter_server_reduce_and_broadcast_name_the_server():
    labels = _labels(placement_dot(data_plan("parameter_server")))
    assert labels["s1_c0"] == '"reduce grads\\ncuda:0, cuda:1 -> cpu\\n1.0 MiB"'
    assert labels["s1_c1"] == '"broadcast params (step)\\ncpu -> cuda:0, cuda:1\\n1.0 MiB"'


def test_resplit_between_groups():
    src = placement_dot(resplit_plan())
    assert "shape=parallelogram" in src
    assert _labels(src)["t1_0"] == '"re-split act (dim 0 -> whole)\\ncuda:0, cuda:1 -> cuda:2, cuda:3\\nfwd 8.0 KiB"'
    assert {("s0_l0", "t1_0"), ("t1_0", "s1_h")} <= _edges(src)


def test_pipeline_stages_in_order_with_sends_merged_over_microbatches():
    src = placement_dot(pipeline_plan())
    labels = _labels(src)
    assert "<B>stage 0</B>" in src and "<B>stage 2</B>" in src  # `s2` only repeats the number
    assert "stage 0 · s0" not in src
    # the stages of one device group share its colour
    fills = dict(re.findall(r'(s\d)_l0 \[fillcolor="(#\w+)"', src))
    assert fills["s0"] == fills["s2"] != fills["s1"] == fills["s3"]
    assert [n for n in labels if n.startswith("t")] == ["t1_0", "t2_0", "t3_0"]
    assert labels["t2_0"] == '"send act\\ncuda:1 -> cuda:0\\nfwd 8.0 KiB, bwd 8.0 KiB\\neach of 4 micro-batches"'
    assert "pipeline interleaved_1f1b, 4 micro-batches" in src
    assert {("s0_l0", "t1_0"), ("t1_0", "s1_h"), ("s2_l0", "t3_0"), ("t3_0", "s3_h")} <= _edges(src)


def test_chained_transfers_follow_each_other():
    """A merge onto cuda:0 and then a copy on to cuda:2 draw as one path, not two parallel ones."""
    group = ("cuda:0", "cuda:1")
    segs = [seg(0, ["fc1"], group, "data"), seg(1, ["fc2"], ["cuda:2"])]
    ops = [move(OpKind.MERGE, group, ["cuda:0"], 1, bytes=64, src_dim=0),
           move(OpKind.COPY, ["cuda:0"], ["cuda:2"], 1, bytes=64, route="direct")]
    e = _edges(placement_dot(plan_of("chain", ["cuda:0", "cuda:1", "cuda:2"], segs, ops)))
    assert {("s0_l0", "t1_0"), ("t1_0", "t1_1"), ("t1_1", "s1_h")} <= e
    assert ("s0_l0", "t1_1") not in e and ("t1_0", "s1_h") not in e


def test_skip_connections_and_root_params_from_the_graph():
    from placer.model.graph import RootParam

    layers = [LayerInfo(name=n, op="Linear", params=10, param_bytes=40, buffer_bytes=0, in_shape=None,
                        out_shape=None, inputs=ins)
              for n, ins in [("a", ("input",)), ("b", ("a",)), ("c", ("b", "a"))]]
    graph = ModelGraph(layers=tuple(layers), batch_size=2, input_shape=(2, 4), input_dtype="float32",
                       root_params=(RootParam(name="pos", numel=4096, bytes=16384, trainable=True, consumer="b"),))
    plan = plan_of("skip", ["cpu"], [seg(0, ["a", "b", "c"], ["cpu"])], [])
    src = placement_dot(plan, graph)
    assert "s0_l0 -> s0_l2 [style=dotted];" in src and "s0_l1 -> s0_l2 [style=dotted]" not in src
    assert "+ pos (4,096)" in _labels(src)["s0_l1"]


def test_unlowered_plan_draws_direct_edges():
    p = copies_plan().with_ops({})
    e = _edges(placement_dot(p))
    assert {("input", "s0_h"), ("s0_l1", "s1_h"), ("s1_l1", "s2_h")} <= e


@needs_dot
@pytest.mark.parametrize("make", [copies_plan, data_plan, resplit_plan, pipeline_plan])
def test_renders_with_graphviz(make, tmp_path):
    src = placement_dot(make(), small_graph() if make is copies_plan else None)
    proc = subprocess.run(["dot", "-Tsvg"], input=src, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no syntax warnings either
    ET.fromstring(proc.stdout)


@needs_dot
def test_write_diagram_by_suffix(tmp_path):
    src = placement_dot(copies_plan())
    path = write_diagram(src, tmp_path / "a.dot")
    assert path.read_text() == src
    path = write_diagram(src, tmp_path / "sub" / "a.svg")
    assert ET.parse(path).getroot().tag.endswith("svg")
    assert write_diagram(src, tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_diagram(src, tmp_path / "a.pdf").read_bytes()[:5] == b"%PDF-"


def test_write_diagram_without_graphviz_is_an_error(tmp_path, monkeypatch):
    """A picture asked for and graphviz missing: R004 naming the fix, and no file that pretends to be one."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # the graphviz package looks `dot` up on PATH
    with pytest.raises(PlanError) as e:
        write_diagram("digraph x {}\n", tmp_path / "plan.svg")
    d = e.value.diagnostics[0]
    assert d.code == "R004" and "`dot` not found" in d.message and "apt-get install graphviz" in d.hint
    assert not list(tmp_path.glob("plan.*"))
    assert write_diagram("digraph x {}\n", tmp_path / "plan.dot").read_text() == "digraph x {}\n"  # source needs no dot


@needs_dot
def test_write_diagram_reports_graphviz_failure(tmp_path):
    with pytest.raises(PlanError) as e:
        write_diagram("digraph { this is not dot", tmp_path / "bad.svg")
    assert e.value.diagnostics[0].code == "R004" and "syntax error" in e.value.diagnostics[0].message
    assert not (tmp_path / "bad.svg").exists()


def test_write_diagram_unwritable_path_is_a_plan_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(PlanError) as e:
        write_diagram("digraph x {}", tmp_path / "file" / "plan.dot")
    assert e.value.diagnostics[0].code == "R002"


def test_write_diagram_rejects_unknown_suffix(tmp_path):
    with pytest.raises(PlanError) as e:
        write_diagram("digraph x {}", tmp_path / "plan.jpeg")
    assert e.value.diagnostics[0].code == "R001" and ".svg" in e.value.diagnostics[0].hint


def test_every_replica_shows_in_its_segment_header():
    """A data x4 group is four devices, not one box; no segment box sits inside another (the near-empty
    full-height device-group box), and no box has a title for edges to cross."""
    group = ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    plan = plan_of("dp4", list(group), [seg(0, ["fc1", "act1"], group, "data", sync="allreduce")], [])
    src = placement_dot(plan, small_graph())
    header = _labels(src.replace("label=<<", 'label="<').replace("</TABLE>>", '</TABLE>"'))["s0_h"]
    assert [f">{d}</TD>" in header for d in group] == [True] * 4
    assert "data x4" in header
    assert src.count("subgraph cluster_") == 1 and re.findall(r"^\s*label=(.*?);", src, re.M) == ['""']


def test_shapes_are_what_one_device_holds():
    group = ("cuda:0", "cuda:1")
    g = small_graph()
    labels = _labels(placement_dot(data_plan(), g))
    # rows of a data group are split; a single device holds the whole batch
    assert "-> [32, 16] of [64, 16]" in labels["s1_l0"] and labels["s0_l0"].endswith('-> [64, 16]"')
    info = {l.name: l for l in g.layers}
    # a pipeline stage holds one micro-batch; an uneven split says both sizes
    stage = seg(0, ["fc1"], group, "data", stage=0)
    assert per_device_shapes(stage, info, microbatches=4)["fc1"] == (("8", "16"), (16, 16))
    odd = LayerInfo(name="fc1", op="Linear", params=1, param_bytes=4, buffer_bytes=0, in_shape=(9, 4),
                    out_shape=(9, 4))
    assert per_device_shapes(seg(0, ["fc1"], group, "data"), {"fc1": odd})["fc1"][0] == ("5 or 4", "4")
    # tensor: a column half's output (and what follows it) is cut by features until the row half
    pair = [LayerInfo(name=n, op=op, params=p, param_bytes=4 * p, buffer_bytes=0, in_shape=(8, i), out_shape=(8, o))
            for n, op, p, i, o in [("up", "Linear", 10, 4, 6), ("act", "ReLU", 0, 6, 6), ("down", "Linear", 10, 6, 4)]]
    shapes = per_device_shapes(seg(0, ["up", "act", "down"], group, "tensor"), {l.name: l for l in pair})
    assert [shapes[n][0] for n in ("up", "act", "down")] == [("8", "3"), ("8", "3"), ("8", "4")]
