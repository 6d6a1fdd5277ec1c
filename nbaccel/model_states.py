"""A training step's model states, exactly: what `nbaccel.estimate` adds up without running anything.

Parameters, gradients and optimizer states are arithmetic on the model's parameters (numel x element
size; Adam/AdamW keep two moments like the parameter plus a 4-byte ``step`` per parameter tensor, on
the host unless ``fused``/``capturable``; SGD with momentum one buffer; ...). The tests check these
against what torch really allocates.
"""

from __future__ import annotations

import difflib
import inspect

import torch

from .options import option


OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adagrad", "rmsprop", "sparseadam", "none")
# Subclasses first (AdamW is an Adam): a subclass of these keeps the same state.
_KNOWN = ((torch.optim.AdamW, "adamw"), (torch.optim.Adam, "adam"), (torch.optim.SGD, "sgd"),
          (torch.optim.Adagrad, "adagrad"), (torch.optim.RMSprop, "rmsprop"), (torch.optim.SparseAdam, "sparseadam"))


def closest_optimizer(name: str) -> str:
    """" (did you mean adam?)" for a misspelt optimizer name, or ""."""
    close = difflib.get_close_matches(name.lower(), OPTIMIZERS, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _optimizer_spec(optimizer) -> tuple[str, dict]:
    """Name and constructor settings (``defaults``), from a name or an optimizer instance. SGD is
    "sgd-momentum" when any of its groups has momentum; each group's own settings are `_state_groups`'."""
    if isinstance(optimizer, torch.optim.Optimizer):
        name = next((n for cls, n in _KNOWN if isinstance(optimizer, cls)), None)
        if name is None:
            raise ValueError(f"the state size of {type(optimizer).__name__} is not known here (Adam, AdamW, SGD, "
                             f"Adagrad, RMSprop and SparseAdam are); pass the closest of {', '.join(OPTIMIZERS)} "
                             f"by name instead, e.g. {option('optimizer', 'adam')} for an optimizer with two moments")
        if name == "sgd" and any(g.get("momentum", 0) for g in optimizer.param_groups):
            name = "sgd-momentum"
        return name, dict(optimizer.defaults)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        # a trial's optimizer=torch.optim.AdamW was told "got type": the class, where an instance or name goes
        name = next((n for cls, n in _KNOWN if issubclass(optimizer, cls)), None)
        raise TypeError(f"{option('optimizer')} got the class {optimizer.__name__}, not an optimizer: pass an instance "
                        f"over the model's parameters ({optimizer.__name__}(model.parameters(), ...))"
                        + (f" or its name, {option('optimizer', name)}" if name else ""))
    if optimizer is not None and not isinstance(optimizer, str):
        raise TypeError(f"{option('optimizer')} takes one of {', '.join(OPTIMIZERS)} or a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")
    name = (optimizer or "none").lower()
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}{closest_optimizer(name)}; use one of: "
                         f"{', '.join(OPTIMIZERS)}")
    return name, {}


def _state_groups(params, optimizer) -> list[tuple[str, dict, list]]:
    """(kind, settings, parameters among ``params``) of each param group of an optimizer object; for a name,
    one group: the trainable ``params`` with the optimizer's defaults.

    The state's size is decided per group: a real AdamW has decay and no-decay groups, and a group may set
    momentum, amsgrad, centered or fused of its own (the first group's settings, read for all, counted SGD
    momentum buffers for a momentum=0 group, and none for a momentum group after a momentum=0 one).
    """
    name, hyper = _optimizer_spec(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return [(name, hyper, [p for p in params if p.requires_grad])]
    ids = {id(p) for p in params}
    sgd = name.startswith("sgd")
    return [(("sgd-momentum" if g.get("momentum") else "sgd") if sgd else name, g,
             [p for p in g["params"] if id(p) in ids]) for g in optimizer.param_groups]


def optimizer_state_bytes(params, optimizer="adamw") -> tuple[int, int]:
    """(bytes on the parameters' device, bytes on the host) of the optimizer's state, exactly, group by group.

    ``step`` counters are 4-byte float32 tensors, one per parameter tensor, on the host unless
    the group is ``fused`` or ``capturable`` (then on the parameter's device).
    """
    device = host = 0
    for name, hyper, group in _state_groups(params, optimizer):
        d, h = _group_state_bytes(name, hyper, group)
        device, host = device + d, host + h
    return device, host


def _group_state_bytes(name: str, hyper: dict, params: list) -> tuple[int, int]:
    # Adagrad makes its state in its constructor, for every parameter it holds; the others at the first step,
    # for the parameters with a gradient: a frozen one (requires_grad=False) gets none.
    if name != "adagrad":
        params = [p for p in params if p.requires_grad]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    steps_on_device = bool(hyper.get("fused") or hyper.get("capturable"))
    per_param = {"adamw": 2 + bool(hyper.get("amsgrad")), "adam": 2 + bool(hyper.get("amsgrad")),
                 "sgd": 0, "sgd-momentum": 1, "adagrad": 1, "none": 0,
                 "sparseadam": 2,  # dense moments beside a sparse gradient; its step is a Python int
                 "rmsprop": 1 + bool(hyper.get("momentum")) + bool(hyper.get("centered"))}[name]
    has_step = name in ("adamw", "adam", "adagrad", "rmsprop")
    step = 4 * len(params) if has_step else 0
    device_bytes = per_param * nbytes + (step if steps_on_device else 0)
    host_bytes = 0 if steps_on_device else step
    return device_bytes, host_bytes


def make_optimizer(optimizer, params):
    name, hyper = _optimizer_spec(optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        # The constructor gets the object's defaults; each group passed keeps its own settings. Pass only
        # what the constructor accepts (a subclass's defaults may hold more). What decides memory (foreach,
        # fused, capturable, amsgrad, momentum, centered) are constructor arguments, so they are kept.
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            hyper = {k: v for k, v in hyper.items() if k in accepted}
        keep = {k: v for k, v in hyper.items() if k not in ("self", "params")}
        return cls(params, **keep)
    return {"adamw": lambda: torch.optim.AdamW(params), "adam": lambda: torch.optim.Adam(params),
            "sgd": lambda: torch.optim.SGD(params, lr=0.01), "sgd-momentum": lambda: torch.optim.SGD(params, lr=0.01, momentum=0.9),
            "adagrad": lambda: torch.optim.Adagrad(params), "rmsprop": lambda: torch.optim.RMSprop(params),
            "sparseadam": lambda: torch.optim.SparseAdam(params),
            "none": lambda: None}[name]()


def optimizer_plan(optimizer, params: list, name: str = "model") -> list[tuple]:
    """[(optimizer, indices into ``params`` it updates, or None for every trainable one)], one per optimizer.

    An optimizer object updates its own parameters only: the usual sparse setup is SparseAdam over the
    embeddings and SGD/Adam over the rest, and a trial's SparseAdam object, rebuilt over every parameter,
    failed on the dense ones. Several objects (a list) each keep state for theirs; a name is made over all.
    """
    several = isinstance(optimizer, (list, tuple))
    if several and (not optimizer or not all(isinstance(o, torch.optim.Optimizer) for o in optimizer)):
        raise TypeError(f"{option('optimizer')} takes one name or optimizer, or several optimizer objects (one "
                        f"per part of the model, e.g. SparseAdam for the embeddings and AdamW for the rest), got "
                        f"{optimizer!r}")
    plan, seen = [], {}
    index = {id(p): i for i, p in enumerate(params)}
    for opt in optimizer if several else [optimizer]:
        if not isinstance(opt, torch.optim.Optimizer):
            plan.append((opt, None))
            continue
        held = sorted({index[id(p)] for g in opt.param_groups for p in g["params"] if id(p) in index})
        if not held:
            raise ValueError(f"the {type(opt).__name__} passed as {option('optimizer')} holds none of {name}'s "
                             f"parameters (an optimizer of another model, or of a copy?): pass the one built over "
                             f"{name}.parameters(), or a name such as adamw")
        for i in held:
            if i in seen:
                raise ValueError(f"parameter {i} of {name} is in two of the optimizers passed ({seen[i]} and "
                                 f"{type(opt).__name__}): each parameter is updated by one optimizer")
            seen[i] = type(opt).__name__
        plan.append((opt, held))
    return plan


def plan_name(plan: list[tuple]) -> str:
    """"adamw", or "sparseadam+sgd-momentum" for several optimizers."""
    return "+".join(_optimizer_spec(opt)[0] for opt, _ in plan)


def plan_state_bytes(plan: list[tuple], params: list) -> tuple[int, int]:
    """`optimizer_state_bytes` of each optimizer over the parameters it updates, added up."""
    device = host = 0
    for opt, held in plan:
        mine = params if held is None else [params[i] for i in held]
        d, h = optimizer_state_bytes(mine, opt)
        device, host = device + d, host + h
    return device, host


def make_optimizers(plan: list[tuple], params: list, replicas: list) -> list:
    """The plan's optimizers over ``replicas`` (the copies of ``params``, in the same order), each over the
    parameters it holds, group by group (a group's own settings kept), frozen ones too: Adagrad keeps state
    for them, the others skip a parameter without a gradient."""
    made = []
    index = {id(p): i for i, p in enumerate(params)}
    for opt, held in plan:
        if held is None:
            one = make_optimizer(opt, [r for r in replicas if r.requires_grad])
        else:
            groups = [{**{k: v for k, v in g.items() if k != "params"},
                       "params": [replicas[index[id(p)]] for p in g["params"] if id(p) in index]}
                      for g in opt.param_groups]
            one = make_optimizer(opt, [g for g in groups if g["params"]])
        if one is not None:
            made.append(one)
    return made


def _largest_leaf_bytes(model: torch.nn.Module) -> int:
    sizes = [sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules()]
    return max(sizes, default=0)

