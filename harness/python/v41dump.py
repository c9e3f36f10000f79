"""v41dump: write and read v41 activation dumps (schema "v41-dump", version 1).

The same HDF5 layout the C tools write (README.md, section 'Harness'), so a dump made from
your own engine (a PyTorch port, vLLM, ...) can be compared with the CPU
reference by `v41 diff`. Needs numpy and h5py only; torch is imported lazily
by TorchHooks.

    from v41dump import DumpWriter
    with DumpWriter("mine.h5", engine="pytorch", precision="bf16") as w:
        w.set_rows(0, req=[0, 0, 0], pos=[0, 1, 2])
        w.write(0, "embed", x)                      # fp32 values
        w.write(0, "layer.0.attn.q", q, kind="bf16")
        w.write(0, "layer.0.attn.topk", idx)        # ints -> i32 (discrete)

The file is written to PATH.tmp and renamed to PATH by close() (or the end of
the `with` block); on an exception the temp file is removed.
"""
import datetime
import json
import os
import re

import h5py
import numpy as np

SCHEMA = "v41-dump"
VERSION = 1
KINDS = ("f32", "bf16", "i32", "u8")
CHUNK_CAP = 1 << 18  # elements per chunk, as in harness/dump.c

_LAYER_RE = re.compile(r"^layer\.(\d+)\.")
_DSPARK_RE = re.compile(r"^dspark\.(\d+)\.")


def chunk_shape(shape):
    """Full shape with leading dims shrunk until a chunk holds <= 2^18 elements."""
    ch = [max(1, int(d)) for d in shape]
    for i in range(len(ch)):
        tot = int(np.prod(ch))
        if tot <= CHUNK_CAP:
            break
        rest = tot // ch[i]
        if rest >= CHUNK_CAP:
            ch[i] = 1
            continue
        ch[i] = max(1, CHUNK_CAP // rest)
        break
    return tuple(ch)


def infer_kind(arr):
    a = np.asarray(arr)
    if a.dtype == np.bool_ or a.dtype == np.uint8:
        return "u8"
    if np.issubdtype(a.dtype, np.integer):
        return "i32"
    if a.dtype == np.float16:
        return "bf16"  # half-precision engines: compare at the bf16 level
    return "f32"


def bf16_bits(values):
    """Raw bf16 bit patterns (upper halves) of fp32 values that are bf16-exact."""
    v = np.ascontiguousarray(values, dtype=np.float32)
    return (v.view(np.uint32) >> 16).astype(np.uint16)


def round_to_bf16(values):
    """Round fp32 to the nearest bf16 (ties to even), returned as fp32."""
    v = np.ascontiguousarray(values, dtype=np.float32)
    u = v.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    out = r.view(np.float32).copy()
    nan = np.isnan(v)
    out[nan] = v[nan]
    return out


class DumpWriter:
    """Streaming writer: every write() goes to disk immediately."""

    def __init__(self, path, engine="python", precision="", compat="", config_json="",
                 weights_fingerprint="", replay="", threads=0, blas="", gpu="", inject="",
                 command="", model="", deflate=1, n_layers=None):
        self.path = os.fspath(path)
        self.tmp = self.path + ".tmp"
        self.deflate = int(deflate)
        self.n_taps = 0
        self._order = {}
        self.n_layers = n_layers
        if n_layers is None and config_json:
            try:
                self.n_layers = int(json.loads(config_json).get("n_layers"))
            except (ValueError, TypeError, AttributeError):
                self.n_layers = None
        self.f = h5py.File(self.tmp, "w", libver=("v108", "latest"))
        a = self.f.attrs
        a["schema"] = SCHEMA
        a["version"] = np.int32(VERSION)
        for k, v in (("engine", engine), ("precision", precision), ("compat", compat),
                     ("config_json", config_json), ("weights_fingerprint", weights_fingerprint),
                     ("replay", replay), ("blas", blas), ("gpu", gpu), ("inject", inject),
                     ("command", command), ("model", model)):
            a[k] = str(v or "")
        a["threads"] = np.int32(threads)
        a["tool_version"] = "v41dump.py %d" % VERSION
        a["created"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    # -- context manager: rename on success, remove on error
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False

    def _step(self, step):
        g = "step%04d" % int(step)
        if g not in self.f:
            grp = self.f.create_group(g)
            grp.attrs["step"] = np.int32(step)
        return self.f[g]

    def set_requests(self, ids, prompt_len=None, prefix_hit=None):
        ids = np.asarray(ids, dtype=np.int32)
        if "requests" in self.f:
            del self.f["requests"]
        g = self.f.create_group("requests")
        g["id"] = ids
        g["prompt_len"] = np.zeros_like(ids) if prompt_len is None else np.asarray(prompt_len, np.int32)
        g["prefix_hit"] = np.zeros_like(ids) if prefix_hit is None else np.asarray(prefix_hit, np.int32)

    def set_rows(self, step, req, pos):
        g = self._step(step)
        rows = np.stack([np.asarray(req, np.int32), np.asarray(pos, np.int32)], axis=1)
        if "rows" in g:
            del g["rows"]
        ds = g.create_dataset("rows", data=rows)
        ds.attrs["columns"] = "request_id,position"
        g.attrs["n_rows"] = np.int32(rows.shape[0])

    def layer_of(self, name):
        m = _LAYER_RE.match(name)
        if m:
            return int(m.group(1))
        m = _DSPARK_RE.match(name)
        if m and self.n_layers is not None:
            return self.n_layers + int(m.group(1))
        return -1

    def write(self, step, name, values, kind=None, layer=None, order=None, dims=None):
        """Write one tap of one step. kind: f32|bf16|i32|u8 (inferred when None).
        order defaults to the number of taps already written in that step
        (call in execution order). A second write of the same name in a step
        appends along dim 0."""
        if "/" in name or name == "rows" or not name:
            raise ValueError("invalid tap name %r" % name)
        a = np.asarray(values)
        kind = kind or infer_kind(a)
        if kind not in KINDS:
            raise ValueError("kind must be one of %s" % (KINDS,))
        if kind in ("f32", "bf16"):
            a = np.ascontiguousarray(a, dtype=np.float32)
            dt = "<f4"
        elif kind == "i32":
            a64 = np.asarray(a, dtype=np.int64)
            if a64.size and (a64.min() < -2**31 or a64.max() >= 2**31):
                raise ValueError("%s: values do not fit int32" % name)
            a = np.ascontiguousarray(a64, dtype=np.int32)
            dt = "<i4"
        else:
            a = np.ascontiguousarray(a != 0 if a.dtype == np.bool_ else a, dtype=np.uint8)
            dt = "|u1"
        g = self._step(step)
        if name in g:
            ds = g[name]
            if ds.shape[1:] != a.shape[1:] or a.ndim == 0:
                raise ValueError("%s written twice in step %d with different trailing dims" % (name, step))
            n0 = ds.shape[0]
            ds.resize(n0 + a.shape[0], axis=0)
            ds[n0:] = a
            for k in ("rms", "absmax"):
                if k in ds.attrs:
                    del ds.attrs[k]
            return
        if a.ndim == 0:
            ds = g.create_dataset(name, data=a, dtype=dt)
        else:
            kw = {}
            if self.deflate > 0:
                kw = dict(compression="gzip", compression_opts=self.deflate, shuffle=True)
            ds = g.create_dataset(name, data=a, dtype=dt, chunks=chunk_shape(a.shape),
                                  maxshape=(None,) + a.shape[1:], **kw)
        if order is None:
            order = self._order.get(int(step), 0)
        self._order[int(step)] = max(self._order.get(int(step), 0), int(order) + 1)
        ds.attrs["order"] = np.int32(order)
        ds.attrs["kind"] = kind
        ds.attrs["layer"] = np.int32(self.layer_of(name) if layer is None else layer)
        ds.attrs["discrete"] = np.int32(kind in ("i32", "u8"))
        if dims:
            ds.attrs["dims"] = str(dims)
        if kind in ("f32", "bf16"):
            fin = np.isfinite(a)
            v = a[fin].astype(np.float64)
            ds.attrs["rms"] = float(np.sqrt(np.mean(v * v))) if v.size else 0.0
            ds.attrs["absmax"] = float(np.max(np.abs(v))) if v.size else 0.0
            ds.attrs["n_nan"] = np.int64(np.isnan(a).sum())
            ds.attrs["n_inf"] = np.int64(np.isinf(a).sum())
        self.n_taps += 1

    def close(self):
        if self.f is None:
            return
        self.f.attrs["n_taps"] = np.int64(self.n_taps)
        self.f.close()
        self.f = None
        os.replace(self.tmp, self.path)

    def abort(self):
        if self.f is not None:
            self.f.close()
            self.f = None
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


class TorchHooks:
    """Forward hooks on a PyTorch module tree that write each named module's
    output as a tap.

        hooks = TorchHooks(writer, model, {"layers.3.attn": "layer.3.attn.out", ...})
        hooks.step = 0; model(prefill_ids)
        hooks.step = 1; model(next_ids)
        hooks.remove()

    name_map: module path (as in model.named_modules()) -> tap name, or ->
    callable(module, inputs, output) returning a list of (tap name, tensor)
    pairs. With merge_batch=True (default) outputs of 3 or more dims are
    taken as [B, S, ...] and flattened to the schema's rows-first [B*S, ...];
    pass merge_batch=False when the module already returns [T, ...] rows.
    bf16/fp16 tensors are written with kind bf16. Set .step before each
    forward (0 = prefill, k = k-th decode step)."""

    def __init__(self, writer, module, name_map, merge_batch=True):
        import torch  # lazy: torch is optional

        self._torch = torch
        self.writer = writer
        self.step = 0
        self.merge_batch = merge_batch
        self.handles = []
        mods = dict(module.named_modules())
        missing = [k for k in name_map if k not in mods]
        if missing:
            raise KeyError("modules not found: %s" % ", ".join(missing))
        for path, target in name_map.items():
            self.handles.append(mods[path].register_forward_hook(self._make_hook(target)))

    def _to_numpy(self, t):
        torch = self._torch
        kind = None
        if t.dtype in (torch.bfloat16, torch.float16):
            kind = "bf16"
        if t.is_floating_point():
            arr = t.detach().float().cpu().numpy()
        else:
            arr = t.detach().cpu().numpy()
        if self.merge_batch and arr.ndim >= 3:
            arr = arr.reshape((arr.shape[0] * arr.shape[1],) + arr.shape[2:])
        return arr, kind

    def _make_hook(self, target):
        def hook(mod, inputs, output):
            if callable(target):
                pairs = target(mod, inputs, output)
            else:
                out = output[0] if isinstance(output, (tuple, list)) else output
                pairs = [(target, out)]
            for name, t in pairs:
                arr, kind = self._to_numpy(t)
                self.writer.write(self.step, name, arr, kind=kind)
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


class DumpReader:
    """Read a v41 dump: taps in execution order, values as numpy arrays."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.f = h5py.File(self.path, "r")
        a = self.f.attrs
        schema = a.get("schema")
        if isinstance(schema, bytes):
            schema = schema.decode()
        if schema != SCHEMA:
            raise ValueError("%s: not a v41 dump" % self.path)
        if int(a.get("version", -1)) != VERSION:
            raise ValueError("%s: schema version %s, expected %d" % (self.path, a.get("version"), VERSION))

    def close(self):
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @property
    def attrs(self):
        out = {}
        for k, v in self.f.attrs.items():
            out[k] = v.decode() if isinstance(v, bytes) else (v.item() if hasattr(v, "item") else v)
        return out

    def steps(self):
        return sorted(int(k[4:]) for k in self.f if k.startswith("step") and k[4:].isdigit())

    def taps(self):
        """[(step, name, attrs dict)] in execution order (step, order, name)."""
        out = []
        for s in self.steps():
            g = self.f["step%04d" % s]
            for name, ds in g.items():
                if name == "rows" or not isinstance(ds, h5py.Dataset):
                    continue
                at = {k: (v.decode() if isinstance(v, bytes) else (v.item() if hasattr(v, "item") else v))
                      for k, v in ds.attrs.items()}
                at.setdefault("order", 1 << 30)
                at.setdefault("layer", -1)
                at["shape"] = ds.shape
                out.append((s, name, at))
        out.sort(key=lambda t: (t[0], int(t[2]["order"]), t[1]))
        return out

    def read(self, step, name):
        return self.f["step%04d/%s" % (step, name)][()]

    def rows(self, step):
        g = self.f["step%04d" % step]
        return g["rows"][()] if "rows" in g else None

    def requests(self):
        if "requests" not in self.f:
            return None
        return {k: v[()] for k, v in self.f["requests"].items()}


def copy_dump(src, dst, **meta_overrides):
    """Read a dump and write it again through DumpWriter (round-trip check)."""
    with DumpReader(src) as r:
        at = r.attrs
        meta = {k: at.get(k, "") for k in ("engine", "precision", "compat", "config_json",
                                            "weights_fingerprint", "replay", "blas", "gpu",
                                            "inject", "command", "model")}
        meta["threads"] = int(at.get("threads", 0) or 0)
        meta.update(meta_overrides)
        with DumpWriter(dst, **meta) as w:
            req = r.requests()
            if req is not None:
                w.set_requests(req["id"], req.get("prompt_len"), req.get("prefix_hit"))
            for s in r.steps():
                rows = r.rows(s)
                if rows is not None:
                    w.set_rows(s, rows[:, 0], rows[:, 1])
            for s, name, at2 in r.taps():
                w.write(s, name, r.read(s, name), kind=at2.get("kind"), layer=at2.get("layer"),
                        order=at2.get("order"), dims=at2.get("dims"))


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 4 and sys.argv[1] == "copy":
        copy_dump(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "list":
        with DumpReader(sys.argv[2]) as r:
            for s, name, at in r.taps():
                print("step%04d %-40s %-5s %s" % (s, name, at.get("kind", "?"), list(at["shape"])))
    else:
        sys.stderr.write("usage: v41dump.py copy SRC.h5 DST.h5 | list DUMP.h5\n")
        sys.exit(2)
