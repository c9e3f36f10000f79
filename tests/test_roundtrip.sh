#!/bin/sh
# Schema round trip C -> Python -> C: a dump written by the C writer is read
# by harness/python/v41dump.py and written again through its DumpWriter; the
# C diff must find every tap bitwise equal (atol = rtol = 0). Then a dump
# written by Python from plain arrays, with one perturbed tap, is read by the
# C diff, which must name that tap first.
set -u
B=${V41_BUILDDIR:-.}
S=${V41_SRCDIR:-..}
V41=$B/harness/v41
FIX=$B/tests/v41_dump_fixture
PY=${PYTHON3:-python3}
"$PY" -c 'import h5py, numpy' 2>/dev/null || { echo "skip: $PY lacks h5py/numpy"; exit 77; }
T=$(mktemp -d "${TMPDIR:-/tmp}/v41rt.XXXXXX") || exit 99
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; [ -f "$T/out" ] && cat "$T/out"; exit 1; }

"$FIX" "$T/c.h5" || fail fixture
PYTHONPATH="$S/harness/python" "$PY" - "$T/c.h5" "$T/py.h5" <<'PY' || fail "python copy"
import sys
from v41dump import DumpReader, copy_dump
src, dst = sys.argv[1], sys.argv[2]
with DumpReader(src) as r:
    a = r.attrs
    assert a["schema"] == "v41-dump" and a["version"] == 1, a
    assert a["engine"] == "ref" and a["precision"] == "emulate", a
    taps = r.taps()
    assert taps[0][1] == "embed" and taps[1][1] == "layer.0.stream.in", taps[:2]
    kinds = {n: at["kind"] for s, n, at in taps if s == 0}
    assert kinds["layer.0.attn.q"] == "bf16" and kinds["layer.0.attn.topk"] == "i32", kinds
    x = r.read(0, "layer.0.attn.q")
    assert x.shape == (6, 2, 8), x.shape
    assert (x.view("uint32") & 0xFFFF == 0).all(), "bf16 taps must be bf16-exact"
    rows = r.rows(0)
    assert rows.shape == (6, 2) and list(rows[:, 0]) == [0, 0, 0, 1, 1, 1], rows
copy_dump(src, dst, engine="pytorch")
PY
"$V41" diff --atol 0 --rtol 0 "$T/c.h5" "$T/py.h5" >"$T/out" 2>&1; rc=$?
[ $rc = 0 ] || fail "C -> Python -> C not identical (exit $rc)"
n=$(grep -c . "$T/out")
"$V41" diff --verbose --atol 0 --rtol 0 "$T/c.h5" "$T/py.h5" >"$T/out" 2>&1
grep -q "^summary: 51 taps compared, 0 differ" "$T/out" || fail "tap count after round trip"
"$V41" diff --atol 0 --rtol 0 "$T/py.h5" "$T/c.h5" >"$T/out" 2>&1 || fail "reverse direction"

# Python writer from plain arrays, one perturbed tap
PYTHONPATH="$S/harness/python" "$PY" - "$T" <<'PY' || fail "python writer"
import sys, numpy as np
from v41dump import DumpWriter, round_to_bf16
d = sys.argv[1]
rng = np.random.default_rng(5)
x = [rng.standard_normal((4, 8)).astype(np.float32) for _ in range(4)]
idx = np.array([[0, 1], [2, 3], [1, 3], [0, 2]])
for name, bump in (("pa.h5", 0.0), ("pb.h5", 0.3)):
    with DumpWriter(f"{d}/{name}", engine="pytorch", precision="bf16", config_json='{"n_layers": 2}') as w:
        w.set_rows(0, [0] * 4, range(4))
        w.write(0, "embed", round_to_bf16(x[0]), kind="bf16")
        for l in range(2):
            q = x[1 + l].copy()
            if l == 1:
                q[2, 5] += bump
            w.write(0, f"layer.{l}.attn.q", q)
            w.write(0, f"layer.{l}.ffn.gate.indices", idx)
        w.write(0, "logits", x[3] + bump)
PY
"$V41" diff "$T/pa.h5" "$T/pb.h5" >"$T/out" 2>&1; rc=$?
[ $rc = 1 ] || fail "python dumps: exit $rc"
grep -q "^first divergent tap: step0000 layer.1.attn.q " "$T/out" || fail "python perturbation not named first"
grep -q "at \[2,5\]" "$T/out" || fail "python perturbation index"
# a failed Python write leaves no file behind
PYTHONPATH="$S/harness/python" "$PY" - "$T" <<'PY' || fail "abort"
import os, sys
from v41dump import DumpWriter
d = sys.argv[1]
try:
    with DumpWriter(f"{d}/bad.h5") as w:
        w.write(0, "a/b", [1.0])
except ValueError:
    pass
assert not os.path.exists(f"{d}/bad.h5") and not os.path.exists(f"{d}/bad.h5.tmp")
PY
# TorchHooks against a stand-in torch (torch itself is not a dependency): the
# hooked module outputs land as taps, [B,S,...] merged to rows, bf16 -> kind bf16
PYTHONPATH="$S/harness/python" "$PY" - "$T" <<'PY' || fail "TorchHooks"
import sys, types, numpy as np
torch = types.ModuleType("torch")
torch.bfloat16, torch.float16, torch.float32 = "bf16", "f16", "f32"
class Tensor:
    def __init__(self, a, dtype="f32"): self.a, self.dtype = np.asarray(a), dtype
    def is_floating_point(self): return self.a.dtype.kind == "f"
    def detach(self): return self
    def float(self): return Tensor(self.a.astype(np.float32))
    def cpu(self): return self
    def numpy(self): return self.a
class Module:
    def __init__(self, **kids): self.kids, self.hooks = kids, []
    def named_modules(self, prefix=""):
        yield prefix, self
        for k, m in self.kids.items():
            yield from m.named_modules(prefix + ("." if prefix else "") + k)
    def register_forward_hook(self, fn):
        self.hooks.append(fn)
        h = types.SimpleNamespace(remove=lambda: self.hooks.remove(fn))
        return h
    def __call__(self, x):
        y = self.forward(x)
        for fn in self.hooks: fn(self, (x,), y)
        return y
class Lin(Module):
    def __init__(self, s): super().__init__(); self.s = s
    def forward(self, x): return Tensor(x.a * self.s, "bf16")
class Net(Module):
    def forward(self, x):
        h = self.kids["l0"](x)
        return Tensor(self.kids["head"](h).a.astype(np.int32))
torch.Tensor = Tensor
sys.modules["torch"] = torch
from v41dump import DumpWriter, DumpReader, TorchHooks
net = Net(l0=Lin(2.0), head=Lin(0.5))
d = sys.argv[1]
with DumpWriter(f"{d}/hooks.h5", engine="pytorch") as w:
    hooks = TorchHooks(w, net, {"l0": "layer.0.attn.out", "head": "logits"})
    hooks.step = 0; net(Tensor(np.ones((2, 3, 4), np.float32)))
    hooks.step = 1; net(Tensor(np.ones((2, 1, 4), np.float32)))
    hooks.remove()
with DumpReader(f"{d}/hooks.h5") as r:
    t = {(s, n): at for s, n, at in r.taps()}
    assert t[(0, "layer.0.attn.out")]["kind"] == "bf16" and t[(0, "layer.0.attn.out")]["shape"] == (6, 4), t
    assert t[(0, "layer.0.attn.out")]["layer"] == 0 and t[(1, "logits")]["shape"] == (2, 4), t
    assert float(r.read(1, "logits")[0, 0]) == 1.0
PY
"$V41" diff "$T/hooks.h5" "$T/hooks.h5" >"$T/out" 2>&1 || fail "C diff of a TorchHooks dump"
echo "test_roundtrip: ok"
exit 0
