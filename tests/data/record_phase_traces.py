"""Records tests/data/phase_*.json.gz: torch.compile's first and a later call, and a DataLoader epoch
with 0 and 2 workers, profiled on the CPU with torch.profiler (not nbaccel), then trimmed to what
nbaccel reads (cpu_op and user_annotation events; args: input dims, types and concrete inputs). Run from the
repository root: ``python tests/data/record_phase_traces.py`` (about 10 s on 2 cores: the compile).
"""

import gzip
import json
import os
import tempfile

# A cold compile, as a user's first call: inductor's on-disk caches in a fresh folder (set before
# torch is imported; with a warm cache the first call skips most of the compile work).
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor_cache_")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

OUT = os.path.dirname(os.path.abspath(__file__))


def save(prof, name):
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "t.json"))
        with open(os.path.join(tmp, "t.json")) as fh:
            doc = json.load(fh)
    keep = []
    for e in doc["traceEvents"]:
        if e.get("cat") in ("cpu_op", "user_annotation") and e.get("ph") == "X":
            args = {k: v for k, v in (e.get("args") or {}).items() if k in ("Input Dims", "Input type", "Concrete Inputs")}
            keep.append({k: e[k] for k in ("ph", "cat", "name", "pid", "tid", "ts", "dur")} | {"args": args})
    trimmed = {"schemaVersion": doc.get("schemaVersion"), "traceEvents": keep,
               "note": f"recorded by tests/data/record_phase_traces.py, torch {torch.__version__}"}
    with gzip.open(os.path.join(OUT, f"phase_{name}.json.gz"), "wt") as fh:
        json.dump(trimmed, fh)


def f(x, w):
    return torch.nn.functional.gelu(x @ w).sum(dim=1) * 2


cf = torch.compile(f)
x, w = torch.randn(64, 32, requires_grad=True), torch.randn(32, 16, requires_grad=True)
for name in ("compile_first_call", "compile_later_call"):
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        cf(x, w).sum().backward()
    save(p, name)

ds = TensorDataset(torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,)))
net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 32 * 32, 10))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
for workers in (0, 2):
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        for xb, yb in DataLoader(ds, batch_size=64, num_workers=workers):
            opt.zero_grad()
            nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
    save(p, f"dataloader_workers{workers}")
