"""Sums and sorts over plain lists that give pandas' numbers and order to the last bit.

The display path of a profile computes its figures from the loader's column lists, not from
DataFrames (pandas' fixed cost per groupby/sort is most of the time on a profile's few hundred
rows). To stay bit-identical with the DataFrames the API returns, a group total uses the
Kahan-compensated sum of pandas' groupby ``sum``, a column total numpy's pairwise sum (what
``Series.sum()`` returns), and a descending sort pandas' own ``nargsort`` (quicksort: equal keys
come out in pandas' order, not necessarily the input order).
"""
from __future__ import annotations

import numpy as np

__all__ = ["kahan_sum", "pairwise_sum", "desc_order"]


def kahan_sum(values) -> float:
    """Sum skipping NaN/None, compensated exactly like pandas' groupby ``sum``."""
    total = comp = 0.0
    for v in values:
        if v is None or v != v:
            continue
        y = v - comp
        t = total + y
        comp = t - total - y
        if comp != comp:
            comp = 0.0
        total = t
    return total


def pairwise_sum(values) -> float:
    """numpy's (pairwise) sum, which is what ``Series.sum()`` returns; NaN/None count as 0, as there."""
    arr = np.array(values if isinstance(values, list) else list(values), dtype=float)  # None -> NaN
    arr[np.isnan(arr)] = 0.0
    return float(arr.sum())


def desc_order(values: list) -> list[int]:
    """Row order of ``sort_values(ascending=False)`` (default quicksort, NaN last) over ``values``.

    The steps of ``pandas.core.sorting.nargsort``: reverse, argsort, reverse back."""
    arr = np.asarray(values, dtype=float)
    mask = np.isnan(arr)
    idx = np.arange(len(arr))
    non_nans = arr[~mask][::-1]
    non_nan_idx = idx[~mask][::-1]
    indexer = non_nan_idx[non_nans.argsort(kind="quicksort")][::-1]
    return np.concatenate([indexer, np.nonzero(mask)[0]]).tolist()


def intervals_union(starts: list[float], ends: list[float]) -> float:
    """Length of the union of the intervals [start, end): time covered at least once."""
    total = 0.0
    cur_s = cur_e = None
    for s, e in sorted(zip(starts, ends)):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e is not None:
        total += cur_e - cur_s
    return total
