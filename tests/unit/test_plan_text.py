"""The plan's text form: round-trips for any plan, reads what it writes, names bad lines."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placer.plan.ir import PHASES, Op, OpKind, PlacedSegment, Plan
from placer.plan.text import PlanTextError, dec, enc, format_plan, parse_plan

DEVICES = ["cpu", "cpu:1", "cuda:0", "cuda:1", "cuda:2", "node1/cuda:0", "node1/cpu"]
names = st.sampled_from(["fc1", "act", "blocks.0", "blocks.11", "lm_head", "a_b", "x9", "s0"])
text = st.text(max_size=12)  # anything: spaces, quotes, `=`, `->`, unicode
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                         st.floats(allow_nan=False, allow_infinity=False), text, names)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3), max_leaves=6)
attr_keys = st.sampled_from(["bucket", "layers", "root", "reduce", "layer", "prev_rows", "_x", "k9"])
opt_keys = st.sampled_from(["sync", "bucket_mb", "overlap", "shard", "server", "dim", "axis", "_y"])
maybe_int = st.one_of(st.none(), st.integers(-3, 40))


@st.composite
def ops(draw, devices):
    group = st.lists(st.sampled_from(devices), min_size=1, max_size=3, unique=True).map(tuple)
    src, dst = draw(st.one_of(st.just(((), ())), st.tuples(group, group),
                              st.tuples(st.just(()), group), st.tuples(group, st.just(()))))
    union = tuple(dict.fromkeys(src + dst))
    devs = draw(st.one_of(group, st.just(union))) if union else draw(group)
    return Op(kind=draw(st.sampled_from(list(OpKind))), devices=devs, segment=draw(st.integers(0, 30)),
              phase=draw(st.sampled_from(PHASES)), tensor=draw(st.one_of(st.just(""), names, text)),
              bytes=draw(st.integers(0, 2**40)), dim=draw(maybe_int), route=draw(st.one_of(st.none(), names, text)),
              microbatch=draw(st.one_of(st.none(), st.integers(0, 64))), src=src, dst=dst,
              src_dim=draw(maybe_int), dst_dim=draw(maybe_int),
              attrs=draw(st.dictionaries(attr_keys, json_values, max_size=3)))


@st.composite
def plans(draw):
    devices = tuple(draw(st.lists(st.sampled_from(DEVICES), min_size=1, max_size=4, unique=True)))
    segments = tuple(
        PlacedSegment(index=i, name=draw(st.one_of(names, text)), layers=tuple(draw(st.lists(names, max_size=4))),
                      devices=tuple(draw(st.lists(st.sampled_from(devices), min_size=1, max_size=3, unique=True))),
                      mode=draw(st.sampled_from(["none", "data", "channel", "tensor", "spatial"])),
                      options=draw(st.dictionaries(opt_keys, json_values, max_size=3)),
                      route=draw(st.sampled_from(["direct", "via_host"])), stage=draw(st.one_of(st.none(),
                                                                                               st.integers(0, 9))))
        for i in range(draw(st.integers(1, 3))))
    plan = Plan(name=draw(st.one_of(names, text)), devices=devices, segments=segments,
                microbatches=draw(st.integers(1, 16)), schedule=draw(st.one_of(st.none(), names)),
                batch_size=draw(st.integers(0, 4096)))
    return plan.with_ops({d: draw(st.lists(ops(devices), max_size=4)) for d in devices})


@settings(max_examples=40, deadline=None)
@given(plans())
def test_parse_format_round_trips(plan):
    text = format_plan(plan)
    assert parse_plan(text) == plan
    assert format_plan(parse_plan(text)) == text


@given(json_values)
def test_value_tokens_round_trip(value):
    token = enc(value)
    assert dec(token) == value
    assert " " not in token or token.startswith(('"', "["))


def test_bare_words_where_unambiguous():
    assert [enc(v) for v in ("cuda:0", "blocks.3..blocks.7", "node1/cpu", "via_host", "1f1b")] == \
        ["cuda:0", "blocks.3..blocks.7", "node1/cpu", "via_host", "1f1b"]
    assert [enc(v) for v in ("null", "3", "1e5", "a b", "", None, True, 25.0)] == \
        ['"null"', '"3"', '"1e5"', '"a b"', '""', "null", "true", "25.0"]


SAMPLE = """\
plan demo batch=16 microbatches=1
devices [cpu,cuda:0,cuda:1]
segment 0 embed @cpu layers=[fc1,act1]
segment 1 middle [cuda:0,cuda:1] mode=data layers=[fc2] sync=allreduce bucket_mb=25.0

device cpu
  compute s0 fwd fc1..act1
  split s1 fwd act cpu->[cuda:0,cuda:1] bytes=4096 route=direct dst_dim=0

device cuda:0
  split s1 fwd act cpu->[cuda:0,cuda:1] bytes=4096 route=direct dst_dim=0
>> compute s1 fwd fc2
  all_reduce s1 bwd grads [cuda:0,cuda:1] bytes=16640 bucket=0 layers=fc2

device cuda:1
"""


def test_reads_a_written_plan_and_marked_lines():
    plan = parse_plan(SAMPLE)
    split = plan.ops["cpu"][1]
    assert (split.kind, split.src, split.dst, split.devices, split.dst_dim, split.bytes) == \
        (OpKind.SPLIT, ("cpu",), ("cuda:0", "cuda:1"), ("cpu", "cuda:0", "cuda:1"), 0, 4096)
    assert plan.ops["cuda:0"][1] == Op(kind=OpKind.COMPUTE, devices=("cuda:0",), segment=1, tensor="fc2")
    assert plan.ops["cuda:0"][2].attrs == {"bucket": 0, "layers": "fc2"}
    assert plan.ops["cuda:1"] == ()
    assert plan.segments[1].options == {"sync": "allreduce", "bucket_mb": 25.0}
    marked = format_plan(plan, marks={("cuda:0", 1)})
    assert ">> compute s1 fwd fc2\n" in marked and marked.count(">>") == 1
    assert parse_plan(marked) == plan


@pytest.mark.parametrize("bad, where", [
    ("plan x\ndevice cpu\n  frobnicate s0 fwd -\n", "line 3: unknown op kind 'frobnicate'"),
    ("plan x\n  compute s0 fwd a\n", "line 2: op outside a `device` section"),
    ("devices [a]\n", "no `plan NAME ...` line"),
    ("plan x\nsegment 0 a @cpu\n", "line 2: segment has no layers"),
    ("plan x\nwhatever\n", "line 2: expected plan, devices, segment or device"),
    ("plan x\ndevice cpu\n  compute s0 fwd a cpu bytes\n", "line 3: expected key=value, got 'bytes'"),
])
def test_errors_name_the_line(bad, where):
    with pytest.raises(PlanTextError, match=where.replace("(", r"\(").replace("[", r"\[")):
        parse_plan(bad)


def test_reserved_attribute_names_are_refused():
    plan = Plan(name="p", devices=("cpu",), segments=()).with_ops(
        {"cpu": [Op(kind=OpKind.STEP, devices=("cpu",), segment=0, attrs={"bytes": 1})]})
    with pytest.raises(ValueError, match="op attribute key 'bytes'"):
        format_plan(plan)
