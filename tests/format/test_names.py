"""The format's names (``ckptio.format.names``)."""

from __future__ import annotations

import pytest

from ckptio.format.names import data_file_name, is_data_file_name


def test_data_file_names():
    assert is_data_file_name(data_file_name("0123456789abcdef", 12)) and not is_data_file_name("x.ckio")
    from ckptio.format.names import parse_data_file_names

    names = [data_file_name("0123456789abcdef", 7), data_file_name("fedcba9876543210", 100000)]
    assert parse_data_file_names(names) == (["0123456789abcdef", "fedcba9876543210"], [7, 100000])
    assert parse_data_file_names([]) == ([], [])
    for bad in ("x.ckio", names[0] + "\n", names[0] + "\n" + names[1], "/" + names[0]):
        with pytest.raises(ValueError, match="not a ckptio data file name"):
            parse_data_file_names([names[1], bad])  # each name whole: none hides in a joined line
