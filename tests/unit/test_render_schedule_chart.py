"""Schedule charts: the SVG parses and shows every slot; the text chart reads as expected."""
from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET

import pytest

from placer.diagnostics import PlanError
from placer.estimate.schedule import simulate
from placer.render.schedule_chart import schedule_svg, schedule_text, title, write_schedule

SVG = "{http://www.w3.org/2000/svg}"


def test_text_chart_1f1b():
    tl = simulate("1f1b", [0, 1], 4, groups=[("cuda:0",), ("cuda:1",)])
    assert schedule_text(tl).splitlines()[:3] == [
        "1f1b: 2 stages on 2 device groups, 4 micro-batches, bubble 20.0% (textbook (p-1)/(m+p-1) 20.0%)",
        "cuda:0 |F0 F1       B0    F2 B1    F3 B2       B3    |",
        "cuda:1 |   F0 B0    F1 B1    F2 B2    F3 B3          |"]
    assert schedule_text(tl).splitlines()[3].startswith("        key: F forward, B backward; the digit after")


def test_text_chart_gpipe_with_a_data_group():
    tl = simulate("gpipe", [0, 1], 2, bwd=1.0, groups=[("cuda:0", "cuda:1"), ("cpu",)])
    assert schedule_text(tl).splitlines()[1:3] == [
        "cuda:0,cuda:1 |F0 F1       B0 B1 |",
        "cpu           |   F0 F1 B0 B1    |"]


def test_text_chart_names_stages_when_groups_hold_several():
    tl = simulate("interleaved_1f1b", [0, 1, 0, 1], 2)
    rows = schedule_text(tl).splitlines()
    assert "(p-1)/(v*m+p-1)" in rows[0] and "the digit before it the stage" in rows[-1]
    assert rows[1].startswith("group0 |0F0 0F1 2F0 ")
    assert all(len(r) == len(rows[1]) for r in rows[1:-1])


def test_text_chart_keeps_every_label_when_stage_times_differ():
    """Stages of very different cost (an interleaved spec's cheap first stage) once cut labels to `F`
    and `F F`: every action keeps its whole `2F1` label, and rows stay lined up in time."""
    tl = simulate("interleaved_1f1b", [0, 1, 0, 1], 4, fwd=[0.01, 1, 0.3, 2])
    rows = schedule_text(tl).splitlines()[1:-1]
    cells = [c for r in rows for c in r.split("|")[1].split()]
    assert sorted(cells) == sorted(f"{st}{k}{mb}" for st in range(4) for k in "FB" for mb in range(4))
    assert all(len(r) <= 160 for r in rows)
    # a backward starts no earlier than its forward on the same row: columns keep time order
    for r in rows:
        assert r.index("0F0" if "0F0" in r else "1F0") < r.index("0B0" if "0B0" in r else "1B0")


def test_text_chart_stays_within_width():
    tl = simulate("1f1b", list(range(8)), 32)
    rows = schedule_text(tl, max_width=100).splitlines()[1:-1]
    assert all(len(r) <= 100 for r in rows) and all(r.endswith("|") for r in rows)


def _svg(tl):
    root = ET.fromstring(schedule_svg(tl))
    texts = [t.text for t in root.iter(SVG + "text")]
    return root, root.findall(SVG + "rect"), texts


def test_svg_parses_and_draws_every_slot():
    tl = simulate("zbv_zero_bubble", [0, 1, 1, 0], 4, groups=[("cuda:0", "a<b&c"), ("cpu",)])
    root, rects, texts = _svg(tl)
    assert root.tag == SVG + "svg"
    tips = [r.find(SVG + "title").text for r in rects if r.find(SVG + "title") is not None]
    assert len(tips) == sum(len(lane) for lane in tl.slots)  # one box per slot, each with its tooltip
    assert title(tl) in texts and "cuda:0,a<b&c" in texts
    assert "bubble 4.0%" in title(tl) and "textbook (p-1)/(v*m+p-1) 11.1%" in title(tl)
    width = float(root.get("width"))
    assert all(0 <= float(r.get("x")) and float(r.get("x")) + float(r.get("width")) <= width + 0.01 for r in rects)


def test_svg_labels_every_box_and_colours_micro_batches():
    tl = simulate("1f1b", [0, 1, 2], 4, fwd=[0.3, 1, 1])  # stage 0's boxes are narrow: the chart widens
    _, rects, texts = _svg(tl)
    busy = [s for lane in tl.slots for s in lane if s.kind != "idle"]
    assert sorted(t for t in texts if t and t[0] in "FB" and t[1:].isdigit()) == sorted(s.label for s in busy)
    # boxes too narrow for any label (a 40x cheaper stage) still tell kind and micro-batch by colour
    tl = simulate("1f1b", [0, 1, 2], 4, fwd=[0.025, 1, 1])
    _, rects, texts = _svg(tl)
    fills = {r.find(SVG + "title").text.split(":")[0]: r.get("fill") for r in rects if r.find(SVG + "title") is not None}
    shown = {k: v for k, v in fills.items() if k != "idle"}
    assert len(set(shown.values())) == len(shown) == 8  # F0..F3, B0..B3: each its own colour
    assert "micro-batch" in texts and {"0", "1", "2", "3"} <= set(texts)  # the legend names the colours


def test_time_axis_in_plain_units_with_room_for_each_tick():
    tl = simulate("1f1b", [0, 1], 4, fwd=[2.5e9, 2.5e9], unit="flop")
    root, rects, texts = _svg(tl)
    ticks = [t for t in root.iter(SVG + "text") if t.text and t.text.endswith("FLOP")]
    assert [t.text for t in ticks[:3]] == ["5 GFLOP", "10 GFLOP", "15 GFLOP"]
    xs = [float(t.get("x")) for t in ticks]
    assert all(b - a >= 6.6 * max(len(t.text) for t in ticks) for a, b in zip(xs, xs[1:]))  # no collisions
    assert any("FLOP each device computes" in t for t in texts if t)
    seconds = simulate("1f1b", [0, 1], 4, fwd=[0.002, 0.002], unit="s")
    assert {"5 ms", "time (seconds)"} <= set(_svg(seconds)[2])


def test_svg_is_deterministic():
    tl = simulate("1f1b", [0, 1, 2], 3, fwd=[1, 2, 1])
    assert schedule_svg(tl) == schedule_svg(simulate("1f1b", [0, 1, 2], 3, fwd=[1, 2, 1]))


@pytest.mark.skipif(shutil.which("neato") is None, reason="graphviz not installed")
@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".pdf", b"%PDF-"), (".svg", b"<svg"),
                                           (".txt", b"1f1b:")])
def test_write_schedule_by_suffix(tmp_path, suffix, magic):
    tl = simulate("1f1b", [0, 1], 4, groups=[("cuda:0",), ("cuda:1",)])
    assert write_schedule(tl, tmp_path / f"s{suffix}").read_bytes().startswith(magic)


def test_write_schedule_refuses_other_suffixes(tmp_path):
    tl = simulate("1f1b", [0, 1], 4)
    with pytest.raises(PlanError) as e:
        write_schedule(tl, tmp_path / "s.jpeg")
    assert e.value.diagnostics[0].code == "R005" and ".png" in e.value.diagnostics[0].hint
    assert not (tmp_path / "s.jpeg").exists()
