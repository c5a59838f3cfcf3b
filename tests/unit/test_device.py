"""Device names as values: one parser for node, type, index and host."""
import pytest

from placer.device import Device


def test_parse():
    d = Device.parse("node1/cuda:3")
    assert (d.node, d.type, d.index, d.local, d.is_host, d.host) == (1, "cuda", 3, "cuda:3", False, "node1/cpu")
    c = Device.parse("cpu")
    assert (c.node, c.index, c.local, c.is_host, c.host) == (0, None, "cpu", True, "cpu")
    assert Device.parse("cpu:2").is_host and Device.parse("cpu:2").local == "cpu:2"
    assert Device.parse("cuda:3").host == "cpu"


def test_no_prefix_means_node0():
    assert Device.parse("node0/cuda:0") == Device.parse("cuda:0") != Device.parse("node1/cuda:0")
    assert Device.parse("node0/cuda:1").host == "node0/cpu"  # named as the spec writes its machine


@pytest.mark.parametrize("name", ["gpu:0", "cuda:x", "node/cuda:0", "cuda:0 ", ""])
def test_rejects_what_is_not_a_device(name):
    with pytest.raises(ValueError):
        Device.parse(name)
