"""The pieces under %memory_budget, without a shell: budget parser, OOM message parser, namespace table."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nbaccel.budget import BudgetError, parse_budget, share_reading, size_reading
from nbaccel.holders import namespace_holders
from nbaccel.oom import is_oom, parse_oom_message
from text_helpers import unfolded

CPU = torch.device("cpu")
GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize("text, expected", [
    ("6GiB", 6 * GiB), ("6GB", 6 * 10**9), ("512MiB", 512 * MiB), ("1.5 GiB", int(1.5 * GiB)), ("0.5", 8 * GiB),
    ("1", 16 * GiB),
])
def test_units_and_shares(text, expected):
    assert parse_budget(text, CPU, total=16 * GiB) == expected


@pytest.mark.parametrize("text, message", [
    ("-5GB", "must be positive"), ("12 parsecs", "cannot read '12 parsecs'"), ("0", "must be positive"),
    ("12", "12 has no unit: write '12%' for 12 % of this host's physical memory, or a size: '12GiB'"), ("17GiB", "larger than this host's physical memory"),
])
def test_bad_budgets_name_the_fix(text, message):
    with pytest.raises(BudgetError, match=message):
        parse_budget(text, CPU, total=16 * GiB)


@pytest.mark.parametrize("text, share", [
    ("-5GB", "0.8"), ("0", "0.8"), ("0.00", "0.8"), (".0", "0.8"), ("0e3", "0.8"), (0, "0.8"), (-0.5, "0.8"),
    ("0GiB", "0.8"), ("0%", "'80%'"), ("0.0%", "'80%'"), ("-5%", "'80%'"),
])
def test_every_budget_that_is_not_positive_is_refused_in_one_wording(text, share):
    # The bare-number and percentage branches (and the sized one) once each said it their own way.
    raw = text.strip() if isinstance(text, str) else repr(text)
    with pytest.raises(BudgetError) as info:
        parse_budget(text, CPU, total=16 * GiB)
    assert str(info.value) == (f"a budget must be positive, got {raw}; write e.g. {share} (a share of this host's "
                               "physical memory) or '6GiB'")


def test_a_share_is_checked_before_the_device_size_is_needed():
    # Both notations: out of range is said first, even where the device's size is unknown.
    for text, said in [("0.00", "must be positive"), ("0%", "must be positive"), ("150%", "at most 100%"),
                       ("12", "12 has no unit")]:
        with pytest.raises(BudgetError, match=said):
            parse_budget(text, CPU, total=0)
    with pytest.raises(BudgetError, match="the size of this host's physical memory is unknown here"):
        parse_budget("80%", CPU, total=0)


# Each unit's size written out here, not read from nbaccel's table: the test pins what the letters mean.
UNIT_BYTES = {"MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50, "EiB": 2**60, "MB": 10**6, "GB": 10**9,
              "TB": 10**12, "PB": 10**15, "EB": 10**18, "M": 2**20, "G": 2**30, "T": 2**40, "Gi": 2**30}


@given(number=st.floats(min_value=1, max_value=1e6, allow_nan=False).map(lambda x: float(f"{x:.4g}")),
       unit=st.sampled_from(sorted(UNIT_BYTES)), space=st.sampled_from(["", " "]))
@settings(max_examples=200, deadline=None)
def test_a_sized_budget_is_the_number_times_its_unit(number, unit, space):
    # _sized reads the text once; the reference is the arithmetic (memory.parse_bytes was, a second parser
    # that nothing in the package called, and that read sizes differently: "1e9" as bytes).
    text = f"{number:g}{space}{unit}"
    expected = float(f"{number:g}") * UNIT_BYTES[unit]
    if expected > 2**64:  # beyond any machine
        with pytest.raises(BudgetError, match="larger than any machine's memory"):
            parse_budget(text, CPU, total=16 * GiB, limit=False)
        return
    if expected < MiB:
        return  # under 1 MiB: the budget's own refusal (tested above)
    assert parse_budget(text, CPU, total=16 * GiB, limit=False) == int(expected)


# Real messages, as torch 2.1+ and older versions print them (numbers from user reports).
CUDA_NEW = ("CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total capacity of 14.57 GiB of which 1.58 GiB "
            "is free. Process 2493055 has 12.02 GiB memory in use. Including non-PyTorch memory, this process has "
            "966.00 MiB memory in use. Of the allocated memory 734.07 MiB is allocated by PyTorch, and 33.93 MiB is "
            "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
CUDA_CAPPED = ("CUDA out of memory. Tried to allocate 3.00 GiB. GPU 1 has a total capacity of 139.72 GiB of which "
               "136.10 GiB is free. Including non-PyTorch memory, this process has 2.52 GiB memory in use. 2.00 GiB "
               "allowed; Of the allocated memory 2.00 GiB is allocated by PyTorch, and 0 bytes is reserved by "
               "PyTorch but unallocated.")
CUDA_OLD = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; 13.20 GiB already "
            "allocated; 1.05 GiB free; 14.10 GiB reserved in total by PyTorch) If reserved memory is >> allocated "
            "memory try setting max_split_size_mb to avoid fragmentation.")
CPU_MSG = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)")


def test_parse_new_cuda_message():
    f = parse_oom_message(CUDA_NEW)
    assert f.source == "cuda" and f.gpu == 0
    assert f.requested == int(1.95 * GiB)
    assert f.capacity == int(14.57 * GiB) and f.free == int(1.58 * GiB)
    assert f.allocated == int(734.07 * MiB) and f.reserved_unallocated == int(33.93 * MiB)
    assert f.process_in_use == int(966 * MiB) and f.allowed is None


def test_parse_capped_cuda_message():
    f = parse_oom_message(CUDA_CAPPED)
    assert f.gpu == 1 and f.requested == 3 * GiB and f.allowed == 2 * GiB and f.reserved_unallocated == 0


def test_parse_old_cuda_message():
    f = parse_oom_message(CUDA_OLD)
    assert f.requested == 2 * GiB and f.capacity == int(15.78 * GiB) and f.free == int(1.05 * GiB)
    assert f.allocated == int(13.2 * GiB)
    assert f.reserved_unallocated == int(14.10 * GiB) - int(13.2 * GiB)


def test_parse_cpu_and_numpy_messages():
    assert parse_oom_message(CPU_MSG).requested == 2**50
    assert parse_oom_message("Unable to allocate 8.00 EiB for an array with shape (2**60,)").requested == 8 * 2**60


def test_is_oom():
    assert is_oom(RuntimeError(CPU_MSG)) and is_oom(torch.OutOfMemoryError(CUDA_NEW)) and is_oom(MemoryError())
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError(CPU_MSG))


# Out of memory outside the caching allocator, as torch 2.13 raises it (torch.AcceleratorError from the
# CUDA runtime; cuBLAS/cuDNN failing to allocate a handle or workspace): no sizes in the text.
CUDA_RUNTIME = ("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API "
                "call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
                "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
CUBLAS = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
CUDNN = "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"


@pytest.mark.parametrize("exc", [torch.AcceleratorError(CUDA_RUNTIME), RuntimeError(CUDA_RUNTIME),
                                 RuntimeError(CUBLAS), RuntimeError(CUDNN)], ids=["accelerator", "runtime",
                                                                                  "cublas", "cudnn"])
def test_out_of_memory_outside_the_caching_allocator_is_recognised_without_sizes(exc):
    assert is_oom(exc)
    f = parse_oom_message(str(exc))
    assert f.source == "cuda" and f.outside_allocator and f.gpu is None
    assert all(getattr(f, name) is None for name in ("requested", "capacity", "free", "allocated",
                                                      "reserved_unallocated", "process_in_use", "allowed"))
    assert not is_oom(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert not is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`"))


def test_a_sizeless_cuda_oom_is_explained_with_the_devices_figures_only(monkeypatch):
    """No made-up numbers: no request, no "needed at least", no guessed GPU index, and the limit is the GPU's
    (read from torch), not the host's physical memory."""
    from nbaccel.oom import explain_oom
    from nbaccel.render.budget import oom_text

    total = 16 * GiB
    props = type("Props", (), {"total_memory": total})()
    read = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: read.append(d) or props)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: 1.0, raising=False)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 3 * GiB)
    exp = explain_oom(torch.AcceleratorError(CUDA_RUNTIME), {})
    assert exp.device == "cuda" and read == [torch.device("cuda")]
    assert exp.limit_bytes == total and "get_device_properties" in exp.limit_source
    assert exp.needed_at_least is None and exp.allocated_bytes == 3 * GiB
    assert [s.action for s in exp.suggestions] == ["torch.cuda.empty_cache() before the step"]
    text = oom_text(exp)
    assert "OUT OF MEMORY on cuda (AcceleratorError)" in text and "requested: not in the message" in text
    assert "outside PyTorch's caching allocator; the message gives no sizes" in unfolded(text)
    assert "needed at least" not in text and "GPU capacity" not in text and "physical memory" not in text
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: 0.25, raising=False)
    capped = explain_oom(RuntimeError(CUBLAS), {})
    assert capped.limit_bytes == 4 * GiB and "per-process cap" in capped.limit_source

    def broken(d=None):
        raise RuntimeError("CUDA error: out of memory")
    monkeypatch.setattr(torch.cuda, "get_device_properties", broken)
    unknown = explain_oom(RuntimeError(CUDNN), {})
    assert unknown.limit_bytes is None and unknown.limit_source.startswith("not known")
    assert "limit:" not in oom_text(unknown)


def test_the_cpu_allocator_refuses_an_impossible_allocation_without_touching_memory():
    with pytest.raises(RuntimeError, match="can't allocate memory") as info:
        torch.empty(2**50, dtype=torch.uint8)
    assert parse_oom_message(str(info.value)).requested == 2**50


def test_namespace_table_counts_storages_once_and_names_owners():
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 50)  # 5000 + 50 floats
    model(torch.randn(3, 100)).sum().backward()
    opt = torch.optim.Adam(model.parameters())
    opt.step()
    big = torch.zeros(1000, 1000)
    ns = {"model": model, "opt": opt, "big": big, "view": big[:10], "w": model.weight,
          "losses": [torch.ones(10) for _ in range(4)], "n": 3, "Out": {5: torch.ones(250)}}
    rows = {h.name: h for h in namespace_holders(ns, top=20)}
    assert rows["model"].nbytes == 2 * 5050 * 4 and "grads" in rows["model"].detail
    assert rows["opt"].nbytes == 2 * 5050 * 4 + 2 * 4  # two moments + a 4-byte step per parameter tensor
    assert rows["big"].nbytes == 4_000_000 and rows["big"].dtype == "fp32" and rows["big"].device == "cpu"
    # each storage once (a user trial: `alias = big; row = big[0]` listed 12 MiB for one 4 MiB storage)
    assert rows["view"].nbytes == 0 and rows["view"].detail == "shares 3.81 MiB with big"
    assert rows["big"].detail == "" and rows["Out[5]"].detail == ""  # whole storages, or too small to remark
    assert rows["w"].nbytes == 0 and rows["w"].detail == "shares 19.5 KiB with model"
    assert rows["losses"].kind == "container" and rows["losses"].nbytes == 160
    assert rows["Out[5]"].nbytes == 1000
    assert "n" not in rows
    assert [h.name for h in namespace_holders(ns, top=2)] == ["big", "opt"]
    # a view alone keeps its whole storage, and says what frees the rest
    rows = {h.name: h for h in namespace_holders({"view": torch.zeros(1000, 1000)[:10]})}
    assert rows["view"].nbytes == 4_000_000
    assert rows["view"].detail == "10x1000 view of a 3.81 MiB storage: .clone() frees the rest"


def test_tensors_in_nested_containers_are_counted():
    """A user trial: `ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})` (12 MiB) and
    a history of per-step dicts were missing from the table and from the OOM explanation."""
    import copy

    model = torch.nn.Linear(100, 100)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 100)).sum().backward()
    opt.step()
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": 3})
    history = [{"step": i, "w": torch.ones(10, 10)} for i in range(4)]
    deep = [[[[[[torch.ones(1000)]]]]]]  # six levels down: past the limit
    losses = [torch.tensor(float(i)) for i in range(20_000)]  # a top-level list is read whole
    rows = {h.name: h for h in namespace_holders({"ckpt": ckpt, "history": history, "deep": deep, "model": model,
                                                  "losses": losses})}
    # the weights, Adam's two moments (four levels down: ckpt -> "opt" -> "state" -> 0) and its steps
    assert rows["ckpt"].nbytes == 3 * (100 * 100 + 100) * 4 + 2 * 4 and rows["ckpt"].detail == "8 tensors"
    assert rows["history"].nbytes == 4 * 400 and rows["history"].detail == "4 tensors"
    assert rows["losses"].nbytes == 20_000 * 4 and rows["losses"].detail == "20000 tensors"
    assert "deep" not in rows
    # a live state_dict's tensors are the model's: a container holding nothing of its own is not a row
    assert [h.name for h in namespace_holders({"model": model, "sd": {"m": model.state_dict()}})] == ["model"]


def test_a_onednn_tensor_counts_its_elements():
    """to_mkldnn() tensors have no storage to show: they read 0 B, device and dtype "-" (a user trial)."""
    mk = torch.randn(512, 512).to_mkldnn()
    rows = {h.name: h for h in namespace_holders({"mk": mk, "same": mk})}
    assert (rows["mk"].nbytes, rows["mk"].device, rows["mk"].dtype) == (512 * 512 * 4, "cpu", "fp32")
    assert rows["same"].nbytes == 0 and rows["same"].detail == "shares 1 MiB with mk"


def test_a_second_name_for_a_storage_or_a_submodule_shares_it():
    """The rows add up to what the names hold: an alias, a displayed result (Out[n] and the name it came
    from), a submodule bound to its own name, each shares the bytes with the first row that holds them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    big = torch.zeros(1000, 1000)
    ns = {"Out": {3: big}, "encoder": model[0], "big": big, "alias": big, "row": big[0], "model": model}
    rows = {h.name: h for h in namespace_holders(ns, top=20)}
    assert rows["big"].nbytes == 4_000_000 and rows["big"].detail == ""  # the user's name, not Out[3]
    for name in ("alias", "row", "Out[3]"):
        assert rows[name].nbytes == 0 and rows[name].detail.endswith("shares 3.81 MiB with big"), name
    assert rows["model"].nbytes == (100 * 100 + 100 + 100 * 10 + 10) * 4  # the larger module counts the shared part
    assert rows["encoder"].nbytes == 0 and rows["encoder"].detail == "params 39.5 KiB; shares 39.5 KiB with model"
    assert sum(h.nbytes for h in rows.values()) == 4_000_000 + rows["model"].nbytes


def test_a_view_named_before_its_base_shares_the_bytes_with_the_base():
    """`head = torch.empty(0)` at the top of a notebook, `big = ...; head = big[:2]` later: head comes first in
    the namespace's order and took big's 3.8 MiB, and big read "shares 3.81 MiB with head"."""
    big = torch.zeros(1000, 1000)
    rows = {h.name: h for h in namespace_holders({"head": big[:2], "loss": big.sum(), "big": big}, top=20)}
    assert rows["big"].nbytes == 4_000_000 and rows["big"].detail == ""
    assert rows["head"].nbytes == 0 and rows["head"].detail.endswith("shares 3.81 MiB with big")
    # a view with no other name still counts what it keeps alive, and says so
    rows = {h.name: h for h in namespace_holders({"head": big[:2]})}
    assert rows["head"].nbytes == 4_000_000 and "view of a 3.81 MiB storage" in rows["head"].detail


def test_an_uninitialized_lazy_module_holds_nothing_and_breaks_nothing():
    """A review: a LazyLinear before its first forward made the status (and the too-large-snapshot
    message, and the OOM explanation) raise torch's "uninitialized parameter" ValueError."""
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Linear(4, 4))
    rows = {h.name: h for h in namespace_holders({"lazy": lazy, "t": torch.ones(8)})}
    assert rows["lazy"].nbytes == sum(p.nbytes for p in lazy[1].parameters()) and rows["t"].nbytes == 32


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_and_nested_tensors_count_their_parts():
    """A sparse tensor has no storage torch will show (`untyped_storage()` raises): the status, the
    OOM explanation and %%amp's too-large-snapshot message raised NotImplementedError on one."""
    dense = torch.zeros(100, 100)
    dense[::10, ::10] = 1.0  # 100 nonzeros
    coo = dense.to_sparse()
    # built from its parts, so that each part's storage is exactly its size (to_sparse_csr() may keep
    # a larger index buffer behind a view, which the table rightly counts whole)
    csr = torch.sparse_csr_tensor(torch.arange(0, 101, dtype=torch.int64), torch.arange(100, dtype=torch.int64),
                                  torch.ones(100), size=(100, 100), check_invariants=True)
    jagged = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
    rows = {h.name: h for h in namespace_holders({"coo": coo, "csr": csr, "jagged": jagged,
                                                  "both": [dense.to_sparse(), csr.clone()]})}
    assert rows["coo"].nbytes == 100 * (2 * 8 + 4)  # two int64 indices and one fp32 value per nonzero
    assert rows["csr"].nbytes == 101 * 8 + 100 * 8 + 100 * 4  # row pointers, column indices, values
    assert rows["coo"].dtype == rows["csr"].dtype == "fp32" and rows["coo"].device == "cpu"
    assert rows["jagged"].nbytes == 6 * 3 * 4 + 3 * 8  # values, and the offsets beside them
    assert rows["both"].nbytes == rows["coo"].nbytes + rows["csr"].nbytes
    assert rows["coo"].detail == rows["csr"].detail == ""  # no view note: a sparse tensor's parts are its memory
    full = torch.randn(100, 100).to_sparse()  # indices and values 5x the dense size: still no "view of" note
    assert namespace_holders({"full": full})[0].detail == ""


def test_a_loss_that_keeps_its_elementwise_buffer_is_named():
    # MSELoss returns a 0-d tensor on the elementwise buffer's storage: `loss` alone keeps 512 KiB here.
    x, y = torch.randn(256, 512), torch.randn(256, 512)
    loss = torch.nn.MSELoss()(x, y)
    rows = {h.name: h for h in namespace_holders({"loss": loss, "scalar": torch.tensor(1.0)})}
    assert rows["loss"].nbytes == loss.untyped_storage().nbytes()
    if loss.untyped_storage().nbytes() >= 64 << 10:  # what torch 2.13 does; say it only when it happens
        assert rows["loss"].detail == "0-d view of a 512 KiB storage: .item() frees the rest"
    assert rows["scalar"].detail == ""


def test_oom_suggestions_are_sized_from_the_numbers():
    from nbaccel.oom import explain_oom

    model = torch.nn.Linear(1000, 1000)  # 4 MB of parameters
    loose = torch.zeros(2_000_000)  # 8 MB that `del` would free
    rss = __import__("nbaccel.memory", fromlist=["current_rss"]).current_rss()
    request = 100 * 2**20
    exc = RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {request} bytes.")
    exp = explain_oom(exc, {"model": model, "loose": loose}, budget=rss + 50 * 2**20)
    actions = {s.action: s for s in exp.suggestions}
    assert exp.facts.requested == request and exp.needed_at_least >= rss + request
    batch = actions["smaller batch"]
    assert "of the current batch fits" in batch.detail and batch.saving_bytes > 0
    assert actions["del loose"].saving_bytes == 8_000_000
    assert actions["mixed precision (torch.autocast bf16/fp16)"].saving_bytes > 0
    assert any(a.startswith("gradient checkpointing") for a in actions)
    exp2 = explain_oom(exc, {"model": model}, budget=rss + 50 * 2**20, per_sample_bytes=2**20, batch=256)
    assert "batch" in exp2.suggestions[0].detail and "(was 256)" in exp2.suggestions[0].detail
    # Says which per-sample figure: the estimate's steeper phase, not the activations column at the batch.
    assert exp2.suggestions[0].detail.startswith("the estimate measured 1 MiB per sample in fp32 (the steeper of "
                                                 "the forward's and the backward's peaks): at most batch ")
    exp3 = explain_oom(exc, {"model": model}, budget=rss + 50 * 2**20, per_sample_bytes=2**20, batch=256,
                       per_sample_precision="bf16 AMP")
    assert exp3.suggestions[0].detail.startswith("the estimate measured 1 MiB per sample in bf16 AMP (")


def _stand_in_allocator(monkeypatch, allocated: int, reserved: int) -> tuple[dict, list]:
    """torch.cuda's allocator statistics on a CPU machine: (its state, to set; the devices each read asked
    for). Only the nested dict the watcher reads and the peak reset are there."""
    state = {"allocated": allocated, "reserved": reserved, "peak_a": allocated, "peak_r": reserved}
    reads = []

    def stats(device=None):
        reads.append(device)
        return {"allocated_bytes": {"all": {"current": state["allocated"], "peak": state["peak_a"]}},
                "reserved_bytes": {"all": {"current": state["reserved"], "peak": state["peak_r"]}}}

    def reset(device=None):
        state["peak_a"], state["peak_r"] = state["allocated"], state["reserved"]

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return state, reads


def test_cuda_watcher_reads_the_allocator_once_per_point(monkeypatch):
    """On CUDA each torch getter (memory_allocated, max_memory_reserved, ...) flattens the whole
    statistics dict; an H200 measured 1.2 ms per watched cell with six of them. The watcher now reads
    the nested dict once before and once after a cell. A stand-in allocator checks the reads and
    the arithmetic on a CPU machine."""
    from nbaccel.budget import Watcher

    state, reads = _stand_in_allocator(monkeypatch, allocated=100 * MiB, reserved=200 * MiB)
    for name in ("memory_stats", "memory_allocated", "memory_reserved", "max_memory_allocated",
                 "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: pytest.fail("a flattening getter was called"))

    w = Watcher(1024 * MiB, torch.device("cuda", 0))
    w.begin("In[1]")
    state["peak_a"], state["peak_r"] = 612 * MiB, 712 * MiB  # the cell allocated 512 MiB, then freed it
    record = w.end()
    assert len(reads) == 2
    assert record.before_bytes == 200 * MiB and record.used_bytes == 712 * MiB  # reserved: compared with the budget
    assert record.added_bytes == 512 * MiB and record.allocated_peak_bytes == 612 * MiB
    assert record.status == "ok"


def test_a_cuda_cell_is_blamed_only_for_what_it_adds(monkeypatch):
    """The CUDA path of the user trial's `del b` (history said "over", added 0 B, for the cell that freed the
    memory): its status comes from the same rule as the CPU's, on the reserved bytes the budget compares."""
    from nbaccel.budget import Watcher

    state, reads = _stand_in_allocator(monkeypatch, allocated=1100 * MiB, reserved=1200 * MiB)
    w = Watcher(1024 * MiB, torch.device("cuda", 0))
    w.begin("In[1]")  # starts over the 1 GiB budget; `del b; torch.cuda.empty_cache()` gives 700 MiB back
    state["allocated"], state["reserved"] = 400 * MiB, 500 * MiB
    freed = w.end()
    assert (freed.status, freed.added_bytes, freed.freed_bytes, freed.used_bytes) == (
        "already over", 0, 700 * MiB, 1200 * MiB)
    w.begin("In[2]")  # goes over: 600 MiB more reserved, kept in the cache after its tensors are freed
    state["peak_a"], state["peak_r"] = 1000 * MiB, 1100 * MiB
    state["reserved"] = 1100 * MiB
    assert (w.end().status, w.records[-1].freed_bytes) == ("over", 0)
    w.begin("In[3]")  # holds those 1100 MiB and adds nothing: already over, not over
    assert (w.end().status, w.records[-1].added_bytes) == ("already over", 0)
    w.begin("In[4]")  # starts over and adds 512 MiB at its peak: to blame again
    state["peak_a"], state["peak_r"] = 912 * MiB, 1612 * MiB
    assert w.end().status == "over"
    assert len(reads) == 8  # the end usage comes from the meter's own read: still one read per point


@pytest.mark.parametrize("before, added, expected", [
    (1100, 0, "already over"), (1100, 0.9, "already over"), (1100, 1, "over"),  # started over: blamed from 1 MiB
    (1023.5, 0.9, "over"),  # started within the budget: crossing it at all is the cell's doing
    (900, 0, "already near"), (700, 100, "near"), (767.8, 0.5, "near"), (900, 200, "over"), (100, 0, "ok"),
])
def test_a_status_blames_a_cell_only_for_what_it_adds(before, added, expected):
    from nbaccel.budget import verdict

    before, added = int(before * MiB), int(added * MiB)
    assert verdict(before, added, 1024 * MiB, 0.75) == expected


def test_a_meter_inside_another_does_not_hide_the_peak_before_it_cuda(monkeypatch):
    """A budget watching a cell whose %%amp memory runs (or the estimator) reset the allocator's peak
    saw only the peak after the last reset (an audit of the CUDA paths): a cell that reached 612 MiB,
    then ran a comparison, was measured at the comparison's 110 MiB."""
    from nbaccel.budget import Watcher
    from nbaccel.memory import PeakMeter

    state, _ = _stand_in_allocator(monkeypatch, allocated=100 * MiB, reserved=200 * MiB)
    w = Watcher(1024 * MiB, torch.device("cuda", 0))
    w.begin("In[1]")
    state["peak_a"], state["peak_r"] = 612 * MiB, 712 * MiB  # the cell allocated 512 MiB, then freed it
    with PeakMeter(torch.device("cuda", 0)) as inner:  # then a memory run inside the cell
        state["peak_a"], state["peak_r"] = 110 * MiB, 210 * MiB
    assert inner.result.peak_bytes == 10 * MiB  # the inner meter measures its own run
    record = w.end()
    assert record.added_bytes == 512 * MiB and record.used_bytes == 712 * MiB


def test_a_meter_inside_another_does_not_hide_the_peak_before_it_cpu():
    from nbaccel.memory import PeakMeter

    MiB = 2**20
    with PeakMeter(torch.device("cpu")) as outer:
        big = torch.ones(256 * MiB // 4)  # touched: 256 MiB resident
        del big
        with PeakMeter(torch.device("cpu")) as inner:  # resets VmHWM as it starts
            torch.ones(1024).sum()
    assert inner.result.peak_bytes < 64 * MiB
    assert outer.result.peak_bytes >= 240 * MiB, outer.result


@pytest.mark.parametrize("budget", [0, -1, -(2**30)])
def test_api_refuses_a_non_positive_byte_count(budget):
    # A new user's nbaccel.memory_budget(0) was accepted and warned "over the budget of 0 B (nan%)".
    import nbaccel
    from nbaccel.budget import BudgetError

    with pytest.raises(BudgetError, match="must be positive"):
        nbaccel.memory_budget(budget, device="cpu")


def test_api_numbers_are_shares_up_to_1_and_bytes_above():
    # From Python a number above 1 is bytes, as in torch's memory APIs (nbaccel.memory_budget(2e9) used
    # to say "'2000000000.0' has no unit"); only the magic's text without a unit is ambiguous.
    import nbaccel
    from nbaccel.budget import BudgetError, device_memory

    total = device_memory(CPU)
    assert nbaccel.memory_budget(1, device="cpu").budget == total
    assert nbaccel.memory_budget(0.5, device="cpu").budget == int(0.5 * total)
    assert nbaccel.memory_budget(2e9, device="cpu").budget == 2_000_000_000
    assert nbaccel.memory_budget(2**30, device="cpu").budget == 2**30
    with pytest.raises(BudgetError, match=r"^budget=1000 is 1000 bytes: a budget under 1 MiB .* did you mean '1000GiB'\?"):
        nbaccel.memory_budget(1000, device="cpu")
    assert nbaccel.memory_budget(f"{2**30}B", device="cpu").budget == 2**30
    with pytest.raises(BudgetError, match="larger than this host's physical memory"):
        nbaccel.memory_budget("999TiB", device="cpu")
    with pytest.raises(BudgetError, match="larger than this host's physical memory"):
        nbaccel.memory_budget(2**60, device="cpu")


@pytest.mark.parametrize("text, expected", [
    ("0.8", 0.8), ("8e-1", 0.8), (".8", 0.8), ("1e0", 1.0), ("1.", 1.0), (0.8, 0.8), (1, 1.0), (8e-1, 0.8),
])
def test_a_number_up_to_1_is_a_share_in_any_notation(text, expected):
    assert parse_budget(text, CPU, total=16 * GiB) == int(expected * 16 * GiB)


@pytest.mark.parametrize("text, message", [
    ("2e9", r"^2e9 has no unit: write '2GB' \(= 2,000,000,000 bytes\) or '1.86GiB'; a number without a unit is a "
            r"share of this host's physical memory \(at most 1"),
    ("2000000000", r"^2000000000 has no unit: write '2GB' \(= 2,000,000,000 bytes\) or '1.86GiB'"),
    (1000, r"^budget=1000 is 1000 bytes: .*did you mean '1000GiB'"),  # from Python a number above 1 is bytes
    (1.5, r"^budget=1.5 is 1.5 bytes: .*did you mean '1.5GiB'"),  # was "is 1 B"
    ("0.5B", r"^0.5B is 0 B: a budget under 1 MiB cannot hold a Python process .*did you mean '0.5GB'\?"),
    ("1B", r"did you mean '1GB'\?"), ("512KiB", r"did you mean '512MiB'\?"),
    ("1e-7", "a share of 1e-7 is .* a budget under 1 MiB"),
    ("-0.5", "must be positive"), (-0.5, "must be positive"), ("nan", "cannot read 'nan'"),
])
def test_unitless_and_tiny_budgets_are_refused_with_a_fix_that_makes_sense(text, message):
    with pytest.raises(BudgetError, match=message):
        parse_budget(text, CPU, total=16 * GiB)


@pytest.mark.parametrize("kwargs, message", [
    ({"budget": None}, r"budget takes a size such as '6GiB' or a share such as 0.8, got NoneType"),
    ({"budget": True}, "budget takes a size"),
    ({"budget": "1GiB", "strict": "yes"}, r"strict takes True or False, got str 'yes'"),
    ({"budget": "1GiB", "near": [0.5]}, r"near takes a share of the budget between 0 and 1 such as 0.75 \(or '75%'\), "
                                        r"got list"),
    ({"budget": "1GiB", "device": ["cpu"]}, r"device takes 'auto', 'cpu'"),
    ({"budget": "1GiB", "namespace": [1]}, r"namespace takes a dict"),
])
def test_api_wrong_types_name_the_argument(kwargs, message):
    import nbaccel

    with pytest.raises(TypeError, match=message):
        nbaccel.memory_budget(**kwargs)


def test_api_near_out_of_range():
    import nbaccel

    with pytest.raises(BudgetError, match=r"near is a share of the budget between 0 and 1, got 1.5"):
        nbaccel.memory_budget("1GiB", near=1.5)
    with pytest.raises(BudgetError, match=r"got 90 \(for 90%: 0.9 or 90%\)$"):  # a percentage without its sign
        nbaccel.memory_budget("1GiB", near=90)


def test_api_near_reads_a_share_as_the_budget_is_read():
    # A trial: near="90%" was a TypeError from Python while --near 90% worked in the magic.
    import nbaccel

    for given in ("90%", "90 %", "0.9", " 0.9 "):
        with nbaccel.memory_budget("1GiB", near=given) as budget:
            assert budget.watcher.near == pytest.approx(0.9), given
    with pytest.raises(BudgetError, match=r"near is a share of the budget between 0% and 100%, got 150%"):
        nbaccel.memory_budget("1GiB", near="150%")
    with pytest.raises(BudgetError, match=r"near takes a share of the budget such as 0.9 or 90%, got 'ninety'"):
        nbaccel.memory_budget("1GiB", near="ninety")


def test_no_nan_or_absurd_share_is_shown():
    from nbaccel.budget import CellRecord, CellReport, share_text

    record = CellRecord("In[1]", 0, 300 * MiB, 0, None, 0, 0.1, "over")
    assert record.fraction is None and record.to_dict()["fraction"] is None
    text = str(CellReport(record, "cpu"))
    assert "nan" not in text and "(n/a)" in text
    assert share_text(0.93) == "93%" and share_text(250.4) == "250x" and share_text(float("nan")) == "n/a"


def test_what_a_cell_freed_is_said_beside_what_it_added():
    from nbaccel.budget import BudgetStatus, CellRecord, CellReport

    def record(added, after):  # started at 900 MiB of a 1 GiB budget
        return CellRecord("In[1]", GiB, 900 * MiB + added, added, None, 900 * MiB, 0.1, "near", after_bytes=after)

    assert "the cell freed 700 MiB" in str(CellReport(record(0, 200 * MiB), "cpu"))  # del b: not "added 0 B"
    assert "the cell added 100 MiB, freed 500 MiB" in str(CellReport(record(100 * MiB, 400 * MiB), "cpu"))
    assert "the cell added 100 MiB;" not in str(CellReport(record(100 * MiB, 400 * MiB), "cpu"))
    assert "freed" not in str(CellReport(record(100 * MiB, 900 * MiB - 2**19), "cpu"))  # under 1 MiB: noise
    table = str(BudgetStatus(True, "cpu", GiB, 16 * GiB, records=[record(0, 200 * MiB)]))
    assert "freed 700 MiB" in table


def test_a_cell_that_rose_and_came_back_down_says_how_much_it_kept():
    """A user trial re-ran `emb = nn.Embedding(100000, 1024)`: its row read "added 390 MiB" while the usage
    after it was what it had been before (the new table is made before the old one is dropped)."""
    from nbaccel.budget import BudgetStatus, CellRecord, CellReport

    def record(added, after):  # started at 400 MiB of a 1 GiB budget
        return CellRecord("In[1]", GiB, 400 * MiB + added, added, None, 400 * MiB, 0.8, "ok", after_bytes=after)

    back = record(390 * MiB, 400 * MiB)
    assert "the cell added 390 MiB at its peak and kept none" in str(CellReport(back, "cpu"))
    assert "390 MiB, none kept" in str(BudgetStatus(True, "cpu", GiB, 16 * GiB, records=[back]))
    assert "the cell added 390 MiB at its peak and kept 20 MiB" in str(CellReport(record(390 * MiB, 420 * MiB), "cpu"))
    # kept all but noise, or no reading of the end: the peak alone, as before
    assert "kept" not in str(CellReport(record(390 * MiB, 790 * MiB - 2**19), "cpu"))
    assert "kept" not in str(CellReport(record(390 * MiB, None), "cpu"))


def test_the_context_manager_says_what_it_is():
    import nbaccel

    b = nbaccel.memory_budget("1GiB", device="cpu")
    with b:
        pass
    assert repr(b) == "<nbaccel memory_budget 1 GiB on cpu (soft), 1 block measured; .history has them>"
    # its status names its rows as the repr does (a trial: "1 cell watched" above a row "block 1")
    text, html = str(b.status()), b.status()._repr_html_()
    assert "1 block watched:" in text and "cell watched" not in text and "last block:" in html
    assert text.splitlines()[text.splitlines().index("1 block watched:") + 1].startswith("block ")


def test_plain_sgd_says_it_keeps_no_state():
    # A new user saw "SGD: no state yet (it is created at the first step)" after many steps.
    model = torch.nn.Linear(10, 10)
    plain, momentum = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1,
                                                                                 momentum=0.9)
    fresh = torch.optim.Adam(model.parameters())
    for _ in range(3):
        model(torch.randn(4, 10)).sum().backward()
        plain.step()
        momentum.step()
    rows = {h.name: h for h in namespace_holders({"plain": plain, "momentum": momentum, "fresh": fresh})}
    assert rows["plain"].detail == "SGD without momentum keeps no state" and rows["plain"].nbytes == 0
    assert rows["momentum"].detail == "SGD state for 2 params" and rows["momentum"].nbytes == 110 * 4
    assert rows["fresh"].detail == "Adam: no state yet (it is created at the first step)"


@pytest.mark.parametrize("text", ["1e309", float("inf"), float("nan")])
def test_a_number_that_is_not_finite_is_refused_plainly(text):
    # "1e309" once got "write infTiB (= inf bytes) or infTB"; float("inf") crashed in int().
    with pytest.raises(BudgetError, match="is not a finite number; write e.g. '6GiB' or 0.8"):
        parse_budget(text, CPU, total=16 * GiB)


@pytest.mark.parametrize("text", ["1PiB", "1PB", "1 PiB", "1EiB", "1EB", "17EiB", "1e30GB"])
def test_petabytes_and_exabytes_are_read_and_found_too_large(text):
    # "1PiB" was "cannot read" while "6 TB" got the size check; a size beyond 2**64 bytes is too large, not unreadable.
    with pytest.raises(BudgetError, match=r"is larger than this host's physical memory \(16 GiB on cpu\)"):
        parse_budget(text, CPU, total=16 * GiB)


def test_a_size_that_is_too_large_is_named_as_written():
    # A trial's "6TB" was refused as "a budget of 5.46 TiB", a number the user never typed.
    with pytest.raises(BudgetError, match=r"^a budget of 6TB \(5.46 TiB\) is larger than this host's"):
        parse_budget("6TB", CPU, total=16 * GiB)
    with pytest.raises(BudgetError, match=r"^a budget of 32 GiB is larger"):  # from Python: bytes, no text to echo
        parse_budget(32 * GiB, CPU, total=16 * GiB)


def test_a_per_gpu_budget_may_be_petabytes_but_not_beyond_any_memory():
    # estimate_memory reads its per-GPU budget without the device limit.
    assert parse_budget("1PiB", CPU, total=16 * GiB, limit=False) == 2**50
    assert parse_budget("2PB", CPU, total=16 * GiB, limit=False) == 2 * 10**15
    assert parse_budget("1EiB", CPU, total=16 * GiB, limit=False) == 2**60
    with pytest.raises(BudgetError, match="larger than any machine's memory"):
        parse_budget("17EiB", CPU, total=16 * GiB, limit=False)


@pytest.mark.parametrize("text, message", [
    ("0GiB", r"^a budget must be positive, got 0GiB"),  # was "did you mean '0GiB'?"
    ("1e309GiB", r"^1e309GiB is not a finite size"),
])
def test_zero_and_infinite_sizes_with_a_unit(text, message):
    with pytest.raises(BudgetError, match=message):
        parse_budget(text, CPU, total=16 * GiB)


@pytest.mark.parametrize("text, expected", [
    # A single letter is binary, as docker (--memory 6g) and systemd (MemoryMax=6G) read it: nbaccel's own
    # --enforce note tells users to write those, and "6G" was refused.
    ("6G", 6 * GiB), ("6g", 6 * GiB), ("6 G", 6 * GiB), ("1.5G", int(1.5 * GiB)), ("512M", 512 * MiB),
    ("512m", 512 * MiB), ("1024K", MiB), ("0.01T", int(0.01 * 2**40)),
])
def test_a_single_letter_unit_is_binary(text, expected):
    assert parse_budget(text, CPU, total=16 * GiB) == expected


def test_how_a_single_letter_was_read_is_said():
    from nbaccel.budget import size_reading

    assert size_reading("6G") == "6G read as 6 GiB, as docker and systemd read G (write 6GB for 6,000,000,000 bytes)"
    assert size_reading(" 512m") == ("512m read as 512 MiB, as docker and systemd read m (write 512MB for "
                                     "512,000,000 bytes)")
    assert [size_reading(t) for t in ("6GiB", "6GB", "0.8", 0.8, "abc")] == [""] * 5


@pytest.mark.parametrize("text, expected, read", [
    ("6Gb", 6 * 10**9, "6 GB"), ("6gb", 6 * 10**9, "6 GB"), (" 512 Mb", 512 * 10**6, "512 MB"),
    ("2Tb", 2 * 10**12, "2 TB"), ("2048kb", 2048 * 10**3, "2048 KB"), ("6Gib", 6 * GiB, "6 GiB"),
    ("512mib", 512 * MiB, "512 MiB"),
])
def test_a_lowercase_b_after_a_prefix_is_bytes_and_said(text, expected, read):
    # Lowercase b is bits by convention; nobody means gigabits for memory, so "6Gb" is 6 GB -- but it
    # was read so silently. The note names the reading, in the unit as it is read.
    total = 16 * 10**12
    assert parse_budget(text, CPU, total=total) == expected == parse_budget(read.replace(" ", ""), CPU, total=total)
    assert size_reading(text) == f"{text.strip()} read as {read} (bytes; a lowercase b usually means bits)"


@pytest.mark.parametrize("text", ["6GB", "6gB", "6GiB", "6giB", "512MB", "6b", "6B", "6G", 6e9])
def test_no_bits_note_where_the_b_is_a_capital_or_has_no_prefix(text):
    assert "bits" not in size_reading(text)


@pytest.mark.parametrize("text, message", [
    ("512K", r"^512K is 512 KiB: a budget under 1 MiB .*did you mean '512M'\?"),
    ("0.5M", r"did you mean '0.5G'\?"), ("2T", "larger than this host's physical memory"),
    ("6Pi", "cannot read '6Pi'"), ("2e", "cannot read '2e'"),  # no P/E letters: "2e" is an unfinished exponent
])
def test_single_letter_sizes_get_the_same_checks(text, message):
    with pytest.raises(BudgetError, match=message):
        parse_budget(text, CPU, total=16 * GiB)


@pytest.mark.parametrize("text, expected", [
    ("80%", 0.8), ("100%", 1.0), ("12.5%", 0.125), ("80 %", 0.8), ("8e1%", 0.8),
])
def test_a_percentage_is_a_share(text, expected):
    assert parse_budget(text, CPU, total=16 * GiB) == int(expected * 16 * GiB)


@pytest.mark.parametrize("text, message", [
    ("0%", r"^a budget must be positive, got 0%; write e.g. '80%' \(a share of this host's physical memory\) or "
           r"'6GiB'$"),
    ("150%", r"^150% is more than all of this host's physical memory: a share is at most 100%; write e.g. '80%', or "
             r"a size such as '6GiB'$"),
    ("-5%", "must be positive"), ("1e-7%", r"^a share of 1e-7% is .* a budget under 1 MiB"),
])
def test_a_percentage_has_the_range_of_a_share(text, message):
    with pytest.raises(BudgetError, match=message):
        parse_budget(text, CPU, total=16 * GiB)


@pytest.mark.parametrize("text, expected", [("6Gi", 6 * 2**30), ("512Mi", 512 * 2**20), ("2 gi", 2 * 2**30)])
def test_kubernetes_binary_suffixes(text, expected):
    # Kubernetes writes memory limits as 6Gi; "cannot read '6Gi'" sent people to the docs for nothing.
    assert parse_budget(text, torch.device("cpu")) == expected
    assert size_reading(text) == ""  # unambiguous: no "read as" note


def test_a_tiny_kubernetes_size_suggests_the_next_unit():
    with pytest.raises(BudgetError, match=r"did you mean '?512Mi'?\?"):
        parse_budget("512Ki", torch.device("cpu"))


def test_a_series_of_cpu_meters_collects_only_new_garbage_and_unfreezes():
    """A CPU %%amp made six full gc.collect() calls, each walking every object in the process (0.17 s
    apiece in a notebook, over a second in a long session). `meter_series` collects once, freezes what
    is alive, and the runs' collections walk only new objects; the garbage a run leaves in a reference
    cycle is still freed before the next run's meter starts."""
    import gc
    import weakref

    from nbaccel.memory import PeakMeter, meter_series

    class Node:
        pass

    assert gc.get_freeze_count() == 0
    with meter_series(CPU):
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the process's objects, left out of the runs' collections
        with PeakMeter(CPU):
            a, b = Node(), Node()
            a.other, b.other = b, a  # a cycle: only the garbage collector frees it
            gone = weakref.ref(a)
            del a, b
        with PeakMeter(CPU):  # starts with a collection
            assert gone() is None
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == 0
    with pytest.raises(KeyboardInterrupt), meter_series(CPU):
        raise KeyboardInterrupt
    assert gc.get_freeze_count() == 0


def test_a_series_leaves_a_process_that_froze_objects_itself_as_it_was():
    import gc

    from nbaccel.memory import meter_series

    gc.freeze()  # a server that forks workers does this
    try:
        mine = gc.get_freeze_count()
        with meter_series(CPU):
            assert gc.get_freeze_count() == mine
        assert gc.get_freeze_count() == mine
    finally:
        gc.unfreeze()
    with meter_series(torch.device("cuda")):  # CUDA meters do not collect: nothing to freeze
        assert gc.get_freeze_count() == 0


def test_a_meter_entered_and_dropped_without_exit_is_not_kept_measuring():
    import gc

    import nbaccel
    from nbaccel.memory import _open_meters

    before = len(_open_meters)
    block = nbaccel.memory_budget("1GiB", device="cpu")
    block.__enter__()  # entered by hand, never exited
    assert len(_open_meters) == before + 1
    del block
    gc.collect()
    assert len(_open_meters) == before


def test_untouched_tensors_above_the_rss_are_said_as_not_resident_yet():
    """A user trial on the CPU: big = torch.empty(64, 20, 200000, 4) (3.81 GiB, never written) was listed at 3.81 GiB
    under "allocated at the failure: 2.29 GiB (process RSS)", with nothing to say why the RSS was lower."""
    from nbaccel.budget import status
    from nbaccel.oom import explain_oom
    from nbaccel.render import budget as budget_render

    big = torch.empty(2**32, dtype=torch.uint8)  # 4 GiB reserved, none of it written: not resident
    ns = {"big": big}
    exp = explain_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 100 bytes."), ns)
    assert exp.device == "cpu" and exp.allocated_bytes < big.nbytes
    says = "pages a tensor has never written (torch.empty, untouched) are not resident yet"
    assert says in unfolded(budget_render.text(exp))
    assert says in unfolded(budget_render.text(status(None, torch.device("cpu"), ns)))
    small = {"x": torch.ones(10)}
    assert says not in budget_render.text(status(None, torch.device("cpu"), small))


def test_a_share_reading_says_what_was_typed_and_of_what():
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert share_reading("50%", gpu, 80 * 2**30) == "50% of the GPU's 80 GiB"
    assert share_reading(" 8e-1", cpu, 16 * 2**30) == "8e-1 of this host's 16 GiB of physical memory"
    assert share_reading(0.5, cpu, 16 * 2**30) == "0.5 of this host's 16 GiB of physical memory"  # from Python
    # sizes are their own reading: the caller says "as given"
    for size in ("6GiB", "6G", 6 * 2**30, True):
        assert share_reading(size, cpu, 16 * 2**30) == ""


def test_unwritten_bytes_count_allocations_not_address_space():
    """A tensor allocated and never written counts; threads (each maps a 64 MiB malloc arena) and a
    written tensor do not."""
    import threading

    from nbaccel.memory import PeakMeter, _can_reset_hwm, malloc_held_bytes

    if malloc_held_bytes() is None or not _can_reset_hwm():
        pytest.skip("no glibc mallinfo2, or no resettable VmHWM, here")
    cpu = torch.device("cpu")
    with PeakMeter(cpu, collect=False) as meter:
        x = torch.empty(300 * 2**20, dtype=torch.uint8)
    assert meter.unwritten_bytes >= 290 * 2**20
    with PeakMeter(cpu, collect=False) as meter:
        x.fill_(1)
    assert meter.unwritten_bytes == 0
    del x
    # Tensors below malloc's mmap threshold come from its heap: 64 x 16 MiB torch.empty read 0 while only
    # mmapped chunks were counted. Freeing a 30 MiB chunk raises the threshold to 30 MiB (glibc's dynamic rule).
    torch.empty(30 * 2**20, dtype=torch.uint8).fill_(0)  # written and freed at once
    with PeakMeter(cpu, collect=False) as meter:
        xs = [torch.empty(16 * 2**20, dtype=torch.uint8) for _ in range(20)]
    assert meter.unwritten_bytes >= 300 * 2**20
    del xs

    def work():
        [bytearray(1000) for _ in range(1000)]

    with PeakMeter(cpu, collect=False) as meter:
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert meter.unwritten_bytes < 16 * 2**20


def test_the_needed_line_is_left_out_where_it_reads_as_the_request():
    """A trial: "requested: 9.09 TiB" then "the step needed at least 9.1 TiB (allocated + requested)", the 276 MiB
    allocated beside it showing only as a rounding. The sum is said where the allocated part is 1% of it or more."""
    from nbaccel.oom import explain_oom
    from nbaccel.render.budget import oom_text

    rss = __import__("nbaccel.memory", fromlist=["current_rss"]).current_rss()
    for request, said in ((10**13, False), (rss, True)):
        exc = RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {request} bytes.")
        text = oom_text(explain_oom(exc, {}, budget=2 * GiB))
        assert ("the step needed at least" in text) is said, text


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="Linux /proc peak reset")
def test_the_rss_at_a_blocks_end_is_read_after_the_freed_heap_is_handed_back(monkeypatch):
    """A trial: a training cell that kept nothing read "80.6 MiB kept" (glibc's heap of freed tensors, not yet
    handed back). 20,000 small tensors made and freed: up to 87 MiB "kept" without the trim at the end, 0 with it."""
    import nbaccel.memory as memory
    from nbaccel.memory import PeakMeter, current_rss, malloc_trim

    if memory._libc_trim() is None:
        pytest.skip("no glibc malloc_trim here")

    def kept(trim_from):
        monkeypatch.setattr(memory, "KEPT_TRIM_BYTES", trim_from)
        malloc_trim()
        before = current_rss()
        with PeakMeter(torch.device("cpu")) as meter:
            xs = [torch.ones(1000) for _ in range(20_000)]
            del xs
        return meter.rss_after - before

    threshold = memory.KEPT_TRIM_BYTES
    # The heap glibc keeps without the trim (else this test proves nothing): 83-87 MiB alone, 21 MiB after the
    # budget tests had left free heap of their own to reuse; with the trim, under 4 MiB either way.
    untrimmed, trimmed = kept(2**62), kept(threshold)
    assert untrimmed > trimmed + 8 * 2**20, (untrimmed, trimmed)
    assert trimmed < 4 * 2**20


def test_a_scripts_oom_explanation_does_not_speak_of_a_kernel():
    """A trial's script printed "OUT OF MEMORY on cpu (RuntimeError) -- the kernel is still alive" and exited with
    status 1: outside IPython there is no kernel, and the error most likely ends the script."""
    import subprocess
    import sys

    code = ("import torch, nbaccel\ntry:\n    with nbaccel.memory_budget('1GiB'):\n"
            "        torch.empty(10**13, dtype=torch.uint8)\nexcept RuntimeError as e:\n    print(e.__notes__[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.splitlines()[0] == "OUT OF MEMORY on cpu (RuntimeError)", out
