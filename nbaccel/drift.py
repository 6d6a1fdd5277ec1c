"""How far mixed precision moved a cell's result: per-leaf error between two runs' values.

A value is walked like a pytree (lists, tuples, dicts); float tensors, float numpy arrays and
numbers are compared in float64 on the host. inf/NaN in the same place in both runs are equal;
inf/NaN in one run only is counted apart (``amp_only_nonfinite``, ``fp32_only_nonfinite``), never
folded into the error figures, where it would turn them into NaN.

The relative error of a leaf is its largest absolute difference over the fp32 value's largest
magnitude. For a result far smaller than the values it was computed from, that measures rounding,
not accuracy on the data: ``out.sum()`` of LayerNorm outputs up to 4.6 came to -4e-4 in fp32 and
-3e-5 under bf16, "92 %", where bf16's resolution at one of those outputs alone is 4.6 * 2**-7 = 0.036. The op audit knows those
values for a small result (`flops.OpAudit.magnitude_of`), carried through the products and quotients
that followed as the rounding is (a mean of large sums is judged at its own scale); a leaf whose fp32 value is within one unit
of the recipe's rounding of them (|fp32| <= eps * their magnitude) is ``near_zero``: its relative
error is kept in the leaf but left out of ``max_rel``, and the report gives its absolute difference.

Integer leaves that look like token ids (`is_token_ids`: a generate loop's output) have no relative
error; `compare_tokens` gives the share of positions where the runs chose the same token and, per
sequence, how many positions agreed before the first that differs.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .render.common import format_share

try:  # numpy is a torch dependency in practice, but not a hard one
    import numpy as np
except ImportError:  # pragma: no cover
    np = None


def to_host(value):
    """A host copy of a run's value, for comparison: float tensors and float numpy arrays become
    float64 tensors, numpy scalars Python numbers; containers are walked. Always a copy, so a later
    run that changes the returned object in place (a namespace tensor) cannot change it."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.is_floating_point():
            return value.to("cpu", torch.float64, copy=True)
        return value.to("cpu", copy=True)
    if np is not None and isinstance(value, np.ndarray):
        if value.dtype.kind == "f":
            return torch.from_numpy(value.astype(np.float64, copy=True))
        return value.copy()  # ints, bools, objects...: kept, not compared (like integer tensors)
    if np is not None and isinstance(value, np.generic):
        return value.item()  # np.float32(1.5) -> 1.5, np.int64(3) -> 3
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value) if not hasattr(value, "_fields") else tuple(to_host(v) for v in value)
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if _is_dataclass(value):  # a model's output dataclass (loss, logits): compared field by field
        return {f.name: to_host(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def _is_dataclass(value) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def leaf_dtypes(value) -> list:
    """The dtype of each tensor leaf of a run's value (None for other leaves), in `_leaves` order: what
    two runs' values are made of, before `to_host` turns every float into float64."""
    return [leaf.dtype if isinstance(leaf, torch.Tensor) else None for _, leaf in _leaves(value)]


def reduced_float_leaves(value) -> list[tuple[str, torch.dtype]]:
    """(path, dtype) of each bf16/fp16 tensor leaf of a run's value: what a recipe's run returned in its dtype."""
    return [(path, leaf.dtype) for path, leaf in _leaves(value)
            if isinstance(leaf, torch.Tensor) and leaf.dtype in (torch.bfloat16, torch.float16)]


def leaf_magnitudes(value, magnitude_of) -> dict[str, float]:
    """{leaf path: ``magnitude_of(leaf)``} for the leaves of a run's value it knows (not None)."""
    found = {}
    for path, leaf in _leaves(value):
        size = magnitude_of(leaf)
        if size is not None:
            found[path] = size
    return found


def _leaves(value, prefix="value"):
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{prefix}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{prefix}[{k!r}]")
    elif _is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _leaves(getattr(value, f.name), f"{prefix}[{f.name!r}]")
    elif isinstance(value, torch.Tensor) and value.is_nested:
        # each component on its own: a nested tensor has no dense form to subtract (to_dense refuses a
        # jagged one, a strided one has no sizes)
        for i, v in enumerate(value.unbind()):
            yield from _leaves(v, f"{prefix}[{i}]")
    else:
        yield prefix, value


def _strided(leaf):
    """A sparse (COO, CSR, ...) tensor as its dense values: isfinite and subtraction have no sparse
    kernels, and a sparse result once failed the whole comparison after every run."""
    if isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided:
        return leaf.to_dense()
    return leaf


def _as_float64(leaf) -> torch.Tensor | None:
    """A float leaf as a float64 tensor (numbers as 0-d ones), a complex one as complex128 (its error
    is the modulus of the difference); None for what drift does not compare."""
    if isinstance(leaf, torch.Tensor):
        leaf = _strided(leaf)
        if leaf.is_complex():
            return leaf.to(torch.complex128)
        return leaf.double() if leaf.is_floating_point() else None
    if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
        try:
            return torch.tensor(float(leaf), dtype=torch.float64)
        except OverflowError:  # an int beyond float's range
            return None
    return None


def _leaf_drift(path: str, b: torch.Tensor, a: torch.Tensor, sources: float | None, eps: float | None) -> dict:
    """Errors where both values are finite; inf/NaN in the same place in both count as equal, and
    inf/NaN in one variant only is counted, not folded into the error (it would make it NaN)."""
    finite_b, finite_a = torch.isfinite(b), torch.isfinite(a)
    both = finite_b & finite_a
    same_nonfinite = ~finite_b & ~finite_a & ((b == a) | (torch.isnan(b) & torch.isnan(a)))
    amp_only = int((~finite_a & ~same_nonfinite).sum())  # the recipe made inf/NaN fp32 did not (or another one)
    base_only = int((~finite_b & finite_a).sum())
    diff = (a - b).abs()[both]
    max_abs = diff.max().item() if diff.numel() else 0.0
    scale = b[finite_b].abs().max().item() if bool(finite_b.any()) else 0.0
    return {"name": path, "shape": list(b.shape), "max_abs": max_abs,
            "max_rel": max_abs / scale if scale else (math.inf if max_abs else 0.0),
            # a single value as a number (not a complex one: to_dict() is JSON)
            "base": b.item() if b.numel() == 1 and not b.is_complex() else None,
            "amp": a.item() if a.numel() == 1 and not a.is_complex() else None,
            "amp_only_nonfinite": amp_only, "fp32_only_nonfinite": base_only, "compared": int(both.sum()),
            # the fp32 value's largest magnitude (what max_rel divides by), and that of the values it was
            # computed from (None: not known, a large result or not made in the audited run)
            "largest": scale, "sources": sources,
            # sources > 0: a 0 computed from exact zeros ((x * 0).sum()) is exact, not a cancellation
            "near_zero": bool(sources) and eps is not None and scale <= eps * sources}


def compute_drift(base, amp, magnitudes: dict | None = None, eps: float | None = None) -> dict | None:
    """Max abs / relative error between the two variants' results, per tensor, float numpy array or
    number leaf. Positions that are inf/NaN in one variant only are counted separately
    (``amp_only_nonfinite``, ``fp32_only_nonfinite``); positions equal-nonfinite in both are equal.

    ``magnitudes`` ({leaf path: magnitude of the values the fp32 leaf was computed from},
    `leaf_magnitudes`) and ``eps`` (the recipe's rounding, `resolution`) mark the ``near_zero``
    leaves; ``max_rel`` is the largest relative error of the others, None when every leaf is near zero.
    """
    base, amp = to_host(base), to_host(amp)
    magnitudes = magnitudes or {}
    leaves = []
    for (path, b), (_, a) in zip(_leaves(base), _leaves(amp)):
        number = not isinstance(b, torch.Tensor)
        if number != (not isinstance(a, torch.Tensor)):
            continue
        b, a = _as_float64(b), _as_float64(a)
        if b is None or a is None or b.shape != a.shape or b.numel() == 0:
            continue
        leaves.append(_leaf_drift(path, b, a, magnitudes.get(path), eps))
    if not leaves:
        return None
    judged = [leaf["max_rel"] for leaf in leaves if not leaf["near_zero"]]
    return {"leaves": leaves, "max_abs": max(leaf["max_abs"] for leaf in leaves),
            "max_rel": max(judged) if judged else None,
            "near_zero": [leaf["name"] for leaf in leaves if leaf["near_zero"]],
            "amp_only_nonfinite": sum(leaf["amp_only_nonfinite"] for leaf in leaves),
            "fp32_only_nonfinite": sum(leaf["fp32_only_nonfinite"] for leaf in leaves),
            # elements finite in both runs: with none (an fp16 overflow made every one inf), the
            # errors above are 0 by construction and say nothing
            "compared": sum(leaf["compared"] for leaf in leaves)}


def resolution(recipe) -> float:
    """The relative rounding of a recipe's math: its autocast dtype's eps (bf16 2**-7, fp16 2**-10),
    TF32's 2**-10 without autocast (the fp32 recipe's runs get the same: fused vs unfused kernels and
    reduction order move fp32 by far less)."""
    return torch.finfo(recipe.autocast_dtype).eps if recipe.autocast_dtype is not None else 2.0**-10


def relative_words(max_rel: float, spec: str) -> str:
    """A leaf's relative change as the report says it: an fp32 value of exactly 0 has none to give."""
    return format(max_rel, spec) if math.isfinite(max_rel) else "unbounded: the fp32 value is exactly 0"


def near_zero_figures(leaf: dict, name: str, eps: float) -> str:
    """Why a near-zero leaf's relative drift measures rounding, in figures: "fp32 -0.000397,
    next to values up to 4.59 it was computed from; bf16's resolution at that size is 0.036 (2**-7 x
    4.59)". ``name``: the recipe's dtype; ``eps``: its `resolution`."""
    value = f"{leaf['base']:.3g}" if leaf.get("base") is not None else f"up to {leaf['largest']:.3g}"
    sources = f"{leaf['sources']:.3g}"
    return (f"fp32 {value}, next to values up to {sources} it was computed from; {name}'s resolution at "
            f"that size is {eps * leaf['sources']:.2g} (2**{round(math.log2(eps))} x {sources})")


def runs_differ(drift: dict | None, recipe) -> bool:
    """Whether two runs under the same recipe gave different values, beyond the run-to-run noise of
    nondeterministic kernels (atomics on the GPU) at that recipe's precision."""
    if drift is None:
        return False
    if drift["amp_only_nonfinite"] or drift["fp32_only_nonfinite"]:
        return True
    # A few units of the recipe's rounding (TF32 keeps 10 mantissa bits): reduction order, fused
    # vs unfused kernels under the audit's dispatch mode, atomics. Of the value's own size, or, for a
    # near-zero result, of the values it was computed from, whose rounding it inherits.
    eps = resolution(recipe)
    return any(leaf["max_abs"] > 4 * eps * (leaf["sources"] if leaf["near_zero"] else leaf["largest"])
               for leaf in drift["leaves"])


# Token ids: which integer leaves of a result are compared as token sequences (`compare_tokens`).
# An int64 or int32 tensor (what an embedding takes, what generate() and a greedy decode return), of
# 1 dim (one sequence) or 2 (sequence, position), at least 2 positions long, with no negative entry
# (ids index a vocabulary), in both runs. Not bool masks, uint8 images or int8/int16 quantized values
# (their dtype), not a 0-d step counter or count (no positions), not a 3-d or larger integer tensor
# (no (sequence, position) layout), not one with negative entries (-100 labels, offsets, differences).
# An integer result of that shape that is no token ids (a bincount, a confusion matrix) passes the
# rule too; its agreement share is still the share of equal entries.
TOKEN_DTYPES = (torch.int64, torch.int32)


def is_token_ids(value) -> bool:
    """Whether ``value`` looks like token ids by the rule above."""
    return (isinstance(value, torch.Tensor) and value.dtype in TOKEN_DTYPES and value.layout == torch.strided
            and not value.is_nested and value.dim() in (1, 2) and value.shape[-1] >= 2 and value.numel() > 0
            and not bool((value < 0).any()))


def _prompt_length(base: torch.Tensor, amp: torch.Tensor, prompts) -> int | None:
    """How many leading positions of each sequence are the prompt: the ids of the first of the fp32 run's
    first embedding calls (`flops.OpAudit.embedding_ids`) that every sequence of both runs starts with (one
    of its rows: beam search and num_return_sequences repeat or pick rows) and goes on past. A position
    embedding looked up first, or a cell that trains before it generates, is passed over. None: no such call."""
    for prompt in prompts:
        rows = prompt.reshape(-1, prompt.shape[-1])
        length = rows.shape[1]
        if min(base.shape[-1], amp.shape[-1]) <= length:
            continue
        starts = {tuple(r) for r in rows.tolist()}
        if all(tuple(r) in starts for seq in (base, amp) for r in seq[:, :length].tolist()):
            return length
    return None


def _token_leaf(path: str, b: torch.Tensor, a: torch.Tensor, prompts) -> dict:
    b2, a2 = b.reshape(-1, b.shape[-1]), a.reshape(-1, a.shape[-1])
    leaf = {"name": path, "fp32_shape": list(b.shape), "amp_shape": list(a.shape), "sequences": b2.shape[0],
            "comparable": b.dim() == a.dim() and b2.shape[0] == a2.shape[0]}
    if not leaf["comparable"]:  # another number of sequences: nothing lines up
        return leaf
    start = _prompt_length(b2, a2, prompts)
    offset = start or 0
    common = min(b2.shape[1], a2.shape[1])
    same = b2[:, offset:common] == a2[:, offset:common]
    differ = ~same
    # per sequence: how many positions (new tokens, after a known prompt) agreed before the first that
    # differs; None where every compared position agrees
    where = differ.to(torch.uint8).argmax(1).tolist() if differ.numel() else [0] * differ.shape[0]
    first = [i if d else None for i, d in zip(where, differ.any(1).tolist())]
    return {**leaf, "prompt": start,
            # the positions each run has after the prompt: new tokens where the prompt is known
            "fp32_length": b2.shape[1] - offset, "amp_length": a2.shape[1] - offset,
            "lengths_differ": b2.shape[1] != a2.shape[1],
            "compared": same.numel(), "agree": int(same.sum()),
            "agreement": float(same.sum()) / same.numel() if same.numel() else None,
            "diverged": sum(f is not None for f in first), "first_divergence": first}


def compare_tokens(base, amp, prompts=(), text: bool = True) -> dict | None:
    """Token agreement between the two runs' token-id leaves (`is_token_ids`): the share of positions where
    fp32 and the recipe chose the same token, and per sequence how many positions agreed before the first
    that differs (a generate loop that picks another token once goes on from another text). ``prompts``:
    the ids the fp32 run first fed an embedding (`flops.OpAudit.embedding_ids`); where each sequence
    starts with one of them, the prompt, only the new tokens are counted. Where generation stopped at
    another length, the positions both runs have are compared and ``lengths_differ`` says so; another
    number of sequences is not compared (``comparable`` False). None when no leaf is token ids in both runs.
    ``text``: whether the ids are text (``%%amp`` passes whether the fp32 run looked up an embedding); False words
    them as integer ids and entries (``tokens`` False in the result and its leaves), as a classifier's argmax is."""
    base, amp = to_host(base), to_host(amp)
    leaves = [_token_leaf(path, b, a, prompts) for (path, b), (_, a) in zip(_leaves(base), _leaves(amp))
              if is_token_ids(b) and is_token_ids(a)]
    if not leaves:
        return None
    # Without an embedding lookup in the fp32 run, the integers are no text: a CNN's argmax over 32 images read
    # "tokens identical (1 sequence x 32 positions)". They are counted the same, and worded as ids and entries.
    for leaf in leaves:
        leaf["tokens"] = text
    compared = [leaf for leaf in leaves if leaf["comparable"]]
    positions, agree = sum(leaf["compared"] for leaf in compared), sum(leaf["agree"] for leaf in compared)
    return {"leaves": leaves, "compared": positions, "agree": agree, "tokens": text,
            "agreement": agree / positions if positions else None,
            "sequences": sum(leaf["sequences"] for leaf in compared),
            "diverged": sum(leaf["diverged"] for leaf in compared),
            "lengths_differ": any(leaf["lengths_differ"] for leaf in compared),
            "comparable": bool(compared)}


def median_divergence(leaf: dict) -> float | None:
    """The median, over a token leaf's sequences that diverge, of the positions that agreed first."""
    firsts = sorted(f for f in leaf.get("first_divergence") or () if f is not None)
    if not firsts:
        return None
    mid = len(firsts) // 2
    return float(firsts[mid]) if len(firsts) % 2 else (firsts[mid - 1] + firsts[mid]) / 2


def share_words(part: int, whole: int) -> str:
    """``part`` of ``whole`` as a whole percentage that never rounds to 100 % or 0 % unless it is: 399 of 400
    is 99.8 %."""
    return format_share(part / whole, digits=0)


def token_figures(leaf: dict, name: str) -> str:
    """A token leaf as the report says it: "agree at 87% of the 80 new tokens; 3 of 4 sequences diverge,
    first after 12 of 20 new tokens (median of the 3)". ``name``: the recipe's dtype."""
    if not leaf["comparable"]:
        return (f"not compared: fp32 returned shape {tuple(leaf['fp32_shape'])}, {name} {tuple(leaf['amp_shape'])} "
                f"(another number of {'sequences' if leaf['tokens'] else 'rows'})")
    if not leaf["tokens"]:
        return _id_figures(leaf)
    unit = "new tokens" if leaf["prompt"] else "positions"
    n, sequences = leaf["fp32_length"], leaf["sequences"]
    text = ""
    if leaf["lengths_differ"]:
        n = min(n, leaf["amp_length"])
        text = (f"lengths differ (generation stopped at another length): fp32 has {leaf['fp32_length']} {unit} per "
                f"sequence, {name} {leaf['amp_length']}; over the first {n}: ")
    if leaf["diverged"] == 0:
        if leaf["lengths_differ"]:
            return text + f"agree at every one of the {leaf['compared']} {unit}"
        return text + f"identical in both runs ({sequences} sequence{'s' if sequences != 1 else ''} x {n} {unit})"
    text += f"agree at {share_words(leaf['agree'], leaf['compared'])} of the {leaf['compared']} {unit}; "
    median = median_divergence(leaf)
    verb = divergence_verb(bool(leaf["prompt"]))
    # "after 0 of 16 new tokens" (a trial) reads as nothing happened: at once, it is "at the first"
    where = f"at the first of {n} {unit}" if median == 0 else f"after {median:g} of {n} {unit}"
    if sequences == 1:
        first = "" if leaf["prompt"] or median == 0 else "first "
        return text + f"the sequence {first}{verb}s {where}"
    return (text + f"{leaf['diverged']} of {sequences} sequences {verb}{' ' if median == 0 else ', first '}{where} "
            f"(median of the {leaf['diverged']})" if leaf["diverged"] > 1 else
            text + f"1 of {sequences} sequences {verb}s, {where}")


def divergence_verb(generated: bool) -> str:
    """"diverge" for new tokens after a known prompt: a generate loop that picks another token once goes on
    from another text. "differ" for ids without one, such as a per-position argmax over a language model's
    logits, where one position that differs says nothing of the next (a trial read its 64 positions as
    sequences that "diverge, first after 23")."""
    return "diverge" if generated else "differ"


def ids_noun(tokens: dict) -> str:
    """What a `compare_tokens` result or leaf calls its integers: "tokens" where they are text, else "integer
    ids" (a classifier's argmax)."""
    return "tokens" if tokens["tokens"] else "integer ids"


def _id_figures(leaf: dict) -> str:
    """An integer leaf that is no text (`compare_tokens`'s ``tokens`` False): its equal entries, no sequences
    or divergence points: "identical in both runs (32 entries)", "agree at 97% of the 32 entries (1 differs)"."""
    rows, n = leaf["sequences"], leaf["fp32_length"]
    shape = f"{rows} rows x {n} entries" if len(leaf["fp32_shape"]) == 2 else f"{n} entries"
    if leaf["lengths_differ"]:
        return (f"lengths differ: fp32 has {leaf['fp32_length']} entries per row, the other {leaf['amp_length']}; "
                f"the first {min(n, leaf['amp_length'])} agree at {share_words(leaf['agree'], leaf['compared'])}")
    differ = leaf["compared"] - leaf["agree"]
    if not differ:
        return f"identical in both runs ({shape})"
    return (f"agree at {share_words(leaf['agree'], leaf['compared'])} of the {leaf['compared']} entries "
            f"({differ} differ{'s' if differ == 1 else ''})")


def tokens_differ(tokens: dict | None) -> bool:
    """Whether the two runs' token ids differ anywhere they can be compared, or in their lengths or number."""
    return bool(tokens) and (not tokens["comparable"] or tokens["lengths_differ"]
                             or tokens["agree"] < tokens["compared"]
                             or any(not leaf["comparable"] for leaf in tokens["leaves"]))
