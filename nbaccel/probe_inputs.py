"""Example inputs whose first dimension is not the batch: how the estimator's probes cut them, or why they cannot.

The dry run (`nbaccel.dry_run`) makes each probe batch of k samples from the first k rows of every tensor of
the example. Two common inputs have no such rows:

* An `nn.EmbeddingBag`'s flat input, ``model(indices, offsets)``: every bag's indices concatenated in one 1-D
  tensor and each bag's start in another. The batch is the bags: k of them are ``offsets[:k]`` and
  ``indices[:offsets[k]]`` (with ``include_last_offset=True`` offsets has the end too: ``offsets[:k + 1]``).
  Cut row by row, the offsets pointed past the indices kept ("offsets[-1] can not be greater than input's
  length 32 but got offsets[-1] of 927"). `find_bags` recognises the pair, `cut_bags` makes the probes.
* A full graph, ``model(x, edge_index)``: the (2, edges) integer tensor indexes x's rows, the nodes. There is no
  batch to cut (cut nodes leave edges pointing past the end: "index 714 is out of bounds for dimension 0 with
  size 125"), so `graph_refusal` says so before the dry run, and what measures such a step instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlatBags:
    """Where an EmbeddingBag's flat input sits in the example tuple, and its number of bags (the batch)."""

    indices: int  # position of the 1-D indices of every bag, concatenated
    offsets: int  # position of each bag's start in them
    weights: tuple[int, ...]  # per_sample_weights: 1-D floating tensors, one weight per index
    last: bool  # include_last_offset=True: offsets ends with len(indices)
    bags: int

    def words(self, name: str) -> str:
        """The cut, in words, for the method line and the failure message."""
        end = "offsets[:k + 1]" if self.last else "offsets[:k]"
        return (f"{name}'s nn.EmbeddingBag input ({_at(self.indices)}: indices, {_at(self.offsets)}: offsets) is "
                f"{self.bags} bags; a probe of k bags is {end} and indices[:offsets[k]]")


def _at(i: int) -> str:
    """Tensor ``i`` of the example as the caller passed it: ``example[1]``, or ``--input's tensor 1``."""
    from .dry_run import _example_option

    opt = _example_option()
    return f"{opt}'s tensor {i}" if opt.startswith("--") else f"{opt}[{i}]"


def _integer_vector(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 1 and not (t.is_floating_point() or t.is_complex()) \
        and t.dtype != torch.bool and t.layout == torch.strided


def find_bags(model: torch.nn.Module, example) -> FlatBags | None:
    """The (indices, offsets) pair of an example for a model with an `nn.EmbeddingBag`, or None.

    Recognised by its shape, in EmbeddingBag's own argument order: a 1-D integer tensor followed by one that
    starts at 0, never decreases and ends within it. Bags of one index each (offsets = arange) cut exactly as
    rows would, so a pair of ids and positions read as bags is cut as before."""
    bag_layers = [m for m in model.modules() if isinstance(m, torch.nn.EmbeddingBag)]
    if not bag_layers or not isinstance(example, (tuple, list)):
        return None
    for i in range(len(example) - 1):
        indices, offsets = example[i], example[i + 1]
        if not (_integer_vector(indices) and _integer_vector(offsets)) or not len(offsets):
            continue
        if offsets[0] != 0 or (offsets.diff() < 0).any() or offsets[-1] > len(indices):
            continue
        last = any(m.include_last_offset for m in bag_layers) and int(offsets[-1]) == len(indices)
        if len(offsets) - last < 1:  # only the end: no bag to cut
            continue
        weights = tuple(j for j, t in enumerate(example) if j not in (i, i + 1) and isinstance(t, torch.Tensor)
                        and t.dim() == 1 and t.is_floating_point() and len(t) == len(indices))
        return FlatBags(i, i + 1, weights, last, len(offsets) - last)
    return None


def cut_bags(example, bags: FlatBags, batch: int) -> dict[int, torch.Tensor]:
    """The pair (and its per-sample weights) for a probe of ``batch`` bags: the first ``batch`` bags, repeated
    from the first where the example has fewer (as rows are). Bag b's indices are indices[offsets[b]:end of b];
    for batch <= bags this is offsets[:batch] (+ the end) and indices[:offsets[batch]]."""
    indices, offsets = example[bags.indices], example[bags.offsets].long()
    starts = offsets[:bags.bags]
    ends = torch.cat([offsets[1:], offsets.new_tensor([len(indices)])])[:bags.bags]
    rows = torch.arange(batch, device=offsets.device) % bags.bags
    lengths = (ends - starts)[rows]
    new_starts = lengths.cumsum(0) - lengths
    # each kept index: its bag's old start + its place in the bag (new position - the bag's new start)
    picked = torch.repeat_interleave(starts[rows] - new_starts, lengths) + torch.arange(
        int(lengths.sum()), device=offsets.device)
    new_offsets = torch.cat([new_starts, lengths.sum().view(1)]) if bags.last else new_starts
    out = {bags.indices: indices[picked], bags.offsets: new_offsets.to(example[bags.offsets].dtype)}
    for j in bags.weights:
        out[j] = example[j][picked]
    return out


def example_tensors(example) -> tuple:
    """The tensors of an example as the model is called with them: a dict's values (``model(**batch)``), a
    tuple's or list's items (``model(*batch)``), or the one tensor."""
    if isinstance(example, Mapping):
        return tuple(example.values())
    return tuple(example) if isinstance(example, (tuple, list)) else (example,)


def example_rows(model: torch.nn.Module, example) -> int | None:
    """How many samples ``example`` holds, as the dry run cuts it: its bags (`find_bags`), else the first
    dimension its tensors share; None where they share none (a tensor and its lengths, a graph)."""
    bags = find_bags(model, example)
    if bags is not None:
        return bags.bags
    firsts = {t.shape[0] for t in example_tensors(example) if isinstance(t, torch.Tensor) and t.dim() >= 1}
    return firsts.pop() if len(firsts) == 1 else None


def graph_refusal(example, name: str) -> str | None:
    """Why a graph's example cannot be cut into probe batches, with what to do instead; None for other inputs.

    A graph: a (2, edges) integer tensor whose values index the rows of another tensor of the example (a GNN's
    edge_index over the node features x)."""
    from .options import in_magic

    if not isinstance(example, (tuple, list)):
        return None
    for i, edges in enumerate(example):
        if not (isinstance(edges, torch.Tensor) and edges.dim() == 2 and edges.shape[0] == 2 and edges.numel()
                and edges.layout == torch.strided and not (edges.is_floating_point() or edges.dtype == torch.bool)):
            continue
        low, high = int(edges.min()), int(edges.max())
        nodes = next((j for j, t in enumerate(example) if j != i and isinstance(t, torch.Tensor) and t.dim()
                      and t.shape[0] > max(high, 2)), None)
        if low < 0 or nodes is None:
            continue
        measure = ("%memory_budget 0.9, then run one training step on the full graph in a cell: %memory_budget "
                   "status shows that cell's measured peak (peak used; added: what the cell added)" if in_magic() else
                   "with nbaccel.memory_budget(0.9) as budget: run one training step on the full graph; "
                   "budget.history has its measured peak (used_bytes; added_bytes: what the step added)")
        return (f"{_at(i)} (shape {tuple(edges.shape)}) holds indices into the {example[nodes].shape[0]:,} rows of "
                f"{_at(nodes)} (a graph's edge_index over its nodes), so {name}'s input has no batch dimension: "
                f"cutting the nodes to a smaller probe batch leaves edges pointing past the end, and the estimator "
                f"fits its prediction through two such probes. Measure the step instead: {measure}")
    return None
