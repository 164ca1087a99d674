"""parse_bytes / format_bytes: the forms people write, and errors that name the bad text and the fix."""

import pytest

from megatrain.planner import format_bytes, parse_bytes


@pytest.mark.parametrize("text, value", [
    ("80GiB", 80 * 2**30), ("80 GiB", 80 * 2**30), ("1.5TiB", int(1.5 * 2**40)), ("512MiB", 2**29),
    ("80GB", 80 * 10**9), ("80gb", 80 * 10**9), ("1024", 1024), ("17B", 17), (4096, 4096), (".5KiB", 512),
])
def test_parse(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["", "eighty", "80 parsecs", "GiB", "-1GiB", "1e3GB", "80GiBs"])
def test_parse_errors_name_text_and_forms(bad):
    with pytest.raises(ValueError) as err:
        parse_bytes(bad)
    msg = str(err.value)
    assert repr(bad) in msg and "GiB" in msg and "\n" not in msg


@pytest.mark.parametrize("bare", ["40G", "40g", "1.5T", "512M", "8k"])
def test_a_bare_unit_letter_is_refused_naming_both_readings(bare):
    """`40G` was read as 40 GB (10^9), 7% short of the 40 GiB a GPU's "40 GB" means: now it names both."""
    with pytest.raises(ValueError) as err:
        parse_bytes(bare)
    number, letter = bare[:-1], bare[-1].upper()
    assert f"{number}{letter}iB" in str(err.value) and f"{number}{letter}B" in str(err.value)


def test_format():
    assert format_bytes(80 * 2**30) == "80 GiB"
    assert format_bytes(1536 * 2**20) == "1.5 GiB"
    assert format_bytes(17) == "17 B"
    assert format_bytes(300 * 2**30) == "300 GiB"
