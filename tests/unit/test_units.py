"""One formatting of sizes and counts for every command and diagram."""
from placer import units


def test_size():
    assert [units.size(n) for n in (0, 512, 1536, 3 << 20, 5 << 40, -2048)] == \
        ["0 B", "512 B", "1.5 KiB", "3.0 MiB", "5.0 TiB", "-2.0 KiB"]
    assert units.MiB == 1024 * units.KiB == 2 ** 20


def test_si_and_count():
    assert [units.si(n) for n in (950, 12_300, 4.56e9, 2e15)] == ["950", "12.3 K", "4.56 G", "2 P"]
    assert [units.count(1, "layer"), units.count(0, "device"), units.count(1024, "parameter")] == \
        ["1 layer", "0 devices", "1,024 parameters"]
