"""The format's names (``ckptio.format.names``)."""

from __future__ import annotations

import hashlib

import pytest

from ckptio.format.names import data_file_name, is_data_file_name, parse_data_file_name, parse_data_file_names


def test_data_file_names():
    assert is_data_file_name(data_file_name("0123456789abcdef", 12)) and not is_data_file_name("x.ckio")
    names = [data_file_name("0123456789abcdef", 7), data_file_name("fedcba9876543210", 100000)]
    assert parse_data_file_names(names) == (["0123456789abcdef", "fedcba9876543210"], [7, 100000], False)
    assert parse_data_file_names([]) == ([], [], False)
    for bad in ("x.ckio", names[0] + "\n", names[0] + "\n" + names[1], "/" + names[0]):
        with pytest.raises(ValueError, match="not a ckptio data file name"):
            parse_data_file_names([names[1], bad])  # each name whole: none hides in a joined line


def test_a_spread_name_sits_under_the_first_two_hex_digits_of_its_plain_names_sha256_and_no_other():
    plain = data_file_name("0123456789abcdef", 7)
    spread = data_file_name("0123456789abcdef", 7, spread=True)
    assert spread == hashlib.sha256(plain.encode()).hexdigest()[:2] + "/" + plain
    assert parse_data_file_name(spread) == ("0123456789abcdef", 7, True)
    assert parse_data_file_name(plain) == ("0123456789abcdef", 7, False)
    others = [f"{p:02x}/{plain}" for p in range(256) if f"{p:02x}/{plain}" != spread]
    assert len(others) == 255 and not any(map(is_data_file_name, others))  # a crafted prefix points nowhere
    for bad in ("../" + plain, spread.upper(), "0/" + plain, "abc/" + plain, spread[:2] + "//" + plain):
        assert not is_data_file_name(bad), bad
    names = [spread, data_file_name("fedcba9876543210", 3, spread=True)]
    assert parse_data_file_names(names) == (["0123456789abcdef", "fedcba9876543210"], [7, 3], True)
    with pytest.raises(ValueError, match="with and without key prefixes"):
        parse_data_file_names([spread, data_file_name("fedcba9876543210", 3)])
    with pytest.raises(ValueError, match="not a ckptio data file name"):
        parse_data_file_names([spread, others[0]])
