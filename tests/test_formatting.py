"""How sizes and durations read in every report: three significant digits, never an exponent."""

from __future__ import annotations

import pytest

from nbaccel.memory import format_bytes
from nbaccel.timing import format_seconds


@pytest.mark.parametrize("n, text", [
    (None, "n/a"), (0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (1536, "1.5 KiB"),
    # 3 significant digits of 1023.4 KiB once read "1.02e+03 KiB" (seen in the benchmark table)
    (1_048_000, "1023 KiB"), (1_048_575, "1 MiB"), (1000 * 2**20, "1000 MiB"), (2**30, "1 GiB"),
    (123.456 * 2**20, "123 MiB"), (-3 * 2**20, "-3 MiB"), (5000 * 2**40, "4.88 PiB"), (2**70, "1024 EiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("seconds, text", [
    (2.5, "2.5 s"), (1500.0, "1500 s"), (1.0, "1 s"),
    (0.9996, "1 s"),  # once "1e+03 ms"
    (0.999, "999 ms"), (0.0123, "12.3 ms"), (0.0009996, "1 ms"), (4.2e-6, "4.2 µs"), (9.9996e-7, "1 µs"),
    (3e-8, "30 ns"), (0.0, "0 ns"),
])
def test_format_seconds(seconds, text):
    assert format_seconds(seconds) == text


def test_text_tables_end_their_lines_without_padding():
    # A terminal trial: %nbaccel_env and the holders table padded every row to the last column's width.
    from nbaccel.render.common import text_table

    text = text_table(["name", "detail"], [["opt", "AdamW state for 4 params"], ["x", ""]], left=(0, 1))
    assert text.splitlines() == ["name  detail", "----  ------------------------", "opt   AdamW state for 4 params",
                                 "x"]


@pytest.mark.parametrize("value, firm, shown", [
    (1.384, True, "1.38x"), (0.92, True, "0.92x"), (0.1, True, "0.10x"),
    # under 0.1x, two decimals left one digit: "0.03x" for a 29.7x slowdown (trial 34)
    (1 / 29.7, True, "0.034x"), (0.05, True, "0.05x"), (0.0042, True, "0.0042x"),
    (17.78, False, "18x"), (1.06, False, "1.1x"), (0.305, False, "0.30x"),
])
def test_a_ratio_keeps_two_significant_digits_at_least(value, firm, shown):
    from nbaccel.timing import format_ratio

    assert format_ratio(value, firm=firm) == shown
