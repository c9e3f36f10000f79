#!/usr/bin/env python3
"""golden_to_v41: convert the oracle's golden.h5 / golden_fixed.h5 into a v41
dump (schema v41-dump v1), so `v41 diff golden.v41.h5 ref.h5` compares the
official code with a ref run of the same inputs.

    golden_to_v41.py GOLDEN.h5 OUT.h5 [--taps-json FILE | --v41 PATH] [--prompts OUT.txt]

The tap table (pattern, dims, kind, golden name) comes from `v41 taps --json`
(--v41 runs it; --taps-json reads a saved copy). Each golden dataset
stepKK/[spec/][layerLL/]NAME whose NAME is some tap's `golden` field becomes
/stepKK/<tap name> (layer {l} = LL; DSpark stage LL >= n_layers becomes
dspark.{LL-n_layers}.*), reshaped from the oracle's [B,S,...] to the engine's
rows-first layout ([T,...], T = B*S requests concatenated; per-request caches
keep [R,...]), and converted to the engine's index conventions:
  - indexer_topk: compressed positions + indexer_offset -> compressed positions
  - attn_topk_idxs: window rows/ring slots -> absolute positions, compressed
    entries minus the window offset (S at prefill, window_size at decode)
  - attn_kv: the window K of this step's rows only (prefill: first S rows;
    decode: ring slot start_pos % window_size)
--prompts writes /prompt_ids as a prompt file for `v41 run --prompt-ids`.
"""
import argparse
import json
import re
import subprocess
import sys
import os

import numpy as np
import h5py

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from v41dump import DumpWriter  # noqa: E402


def load_table(args):
    if args.taps_json:
        with open(args.taps_json) as f:
            return json.load(f)
    exe = args.v41 or "v41"
    out = subprocess.run([exe, "taps", "--json"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def s(v):
    return v.decode() if isinstance(v, bytes) else str(v)


class Mapper:
    def __init__(self, table):
        self.layer = {}   # golden leaf -> desc for layer.{l} patterns
        self.main = {}    # golden leaf -> desc (no {l}, not dspark.*)
        self.spec = {}    # golden leaf -> desc (dspark.* without {l})
        for d in table:
            g = d.get("golden")
            if not g:
                continue
            p = d["pattern"]
            if "{l}" in p:
                self.layer.setdefault(g, d)
            elif p.startswith("dspark."):
                self.spec.setdefault(g, d)
            else:
                self.main.setdefault(g, d)

    def find(self, leaf, where):
        if where == "layer":
            return self.layer.get(leaf)
        first, second = (self.spec, self.main) if where == "spec" else (self.main, self.spec)
        return first.get(leaf) or second.get(leaf)


def rows_first(arr, desc_dims, golden_dims):
    """[B,S,...] -> [B*S,...] for per-row taps (dims [T..], [n_new..], [R*B..]);
    per-request ([R,..]) and returned-row ([O..]) taps keep their shape, as do
    golden tensors already flattened ([B*S,..])."""
    dd = desc_dims.replace(" ", "")
    gd = golden_dims.replace(" ", "")
    if dd.startswith("[O") or (dd.startswith("[R") and not dd.startswith("[R*B")):
        return arr
    if gd.startswith("[B*S") or arr.ndim < 2:
        return arr
    return arr.reshape((arr.shape[0] * arr.shape[1],) + arr.shape[2:])


def convert(golden, out, table, prompts=None):
    m = Mapper(table)
    with h5py.File(golden, "r") as g:
        cfg = json.loads(s(g.attrs["config_json"]))
        n_layers = int(cfg["n_layers"])
        W = int(cfg["window_size"])
        semantics = s(g.attrs.get("index_k_semantics", "official"))
        if prompts:
            with open(prompts, "w") as f:
                for row in g["prompt_ids"][()]:
                    f.write(" ".join(str(int(t)) for t in row) + "\n")
        steps = sorted(int(k[4:]) for k in g if re.fullmatch(r"step\d+", k))
        B, S0 = g["prompt_ids"].shape
        with DumpWriter(out, engine="oracle", precision="emulate",
                        compat="fixed" if semantics == "fixed" else "official",
                        config_json=json.dumps(cfg), model=os.path.dirname(os.path.abspath(golden)),
                        command="golden_to_v41.py " + golden, n_layers=n_layers) as w:
            w.set_requests(np.arange(B), np.full(B, S0))
            for k in steps:
                grp = g["step%02d" % k]
                start = int(grp.attrs["start_pos"])
                S = int(grp.attrs.get("seqlen", 1))
                req = np.repeat(np.arange(B), S)
                pos = np.tile(np.arange(start, start + S), B)
                w.set_rows(k, req, pos)
                items = []   # (order key, name, array, kind, layer)

                def add(where, leaf, ds, layer=None, lgrp=None, stage=None):
                    if leaf.endswith("_bf16bits"):
                        return
                    d = m.find(leaf, where)
                    if d is None:
                        return
                    name = d["pattern"]
                    if layer is not None:
                        if stage is not None:
                            name = "dspark.%d.%s" % (stage, name.split(".", 2)[2])
                        else:
                            name = name.replace("{l}", str(layer))
                    arr = ds[()]
                    gd = s(ds.attrs.get("dims", ""))
                    kind = d["kind"]
                    dspark_stage = stage is not None
                    if leaf == "attn_kv":
                        if dspark_stage:
                            return
                        arr = arr[:, :S] if k == 0 else arr[:, [start % W]]
                    elif leaf == "indexer_topk":
                        off = int(lgrp.attrs.get("indexer_offset", 0)) if lgrp is not None else 0
                        arr = np.where(arr >= 0, arr - off, -1)
                    elif leaf == "attn_topk_idxs":
                        if dspark_stage:
                            return
                        arr = arr.astype(np.int64)
                        if k == 0:
                            off = S
                            win = (arr >= 0) & (arr < off)
                            out_ = np.where(win, arr, np.where(arr >= off, arr - off, -1))
                        else:
                            off = W
                            cur = start
                            slot = arr
                            p = cur - ((cur - slot) % W)
                            out_ = np.where((arr >= 0) & (arr < off), p, np.where(arr >= off, arr - off, -1))
                        arr = out_
                    elif leaf == "input_ids" and where == "spec":
                        return
                    arr = rows_first(np.asarray(arr), d["dims"], gd)
                    if kind in ("i32", "u8"):
                        arr = arr.astype(np.int64)
                    items.append((name, arr, kind, -1 if layer is None else layer))

                for leaf, ds in grp.items():
                    if isinstance(ds, h5py.Dataset):
                        add("main", leaf, ds)
                for lname in sorted(x for x in grp if x.startswith("layer")):
                    L = int(lname[5:])
                    for leaf, ds in grp[lname].items():
                        add("layer", leaf, ds, layer=L, lgrp=grp[lname])
                if "spec" in grp:
                    sp = grp["spec"]
                    for leaf, ds in sp.items():
                        if isinstance(ds, h5py.Dataset):
                            add("spec", leaf, ds)
                    for lname in sorted(x for x in sp if x.startswith("layer")):
                        L = int(lname[5:])
                        for leaf, ds in sp[lname].items():
                            add("layer", leaf, ds, layer=L, lgrp=sp[lname], stage=L - n_layers)
                # execution order: the tap table's order within a layer, layers ascending
                tab_index = {d["pattern"]: i for i, d in enumerate(table)}

                def key(it):
                    name = it[0]
                    mm = re.match(r"^(layer|dspark)\.(\d+)\.(.*)$", name)
                    if mm:
                        L = int(mm.group(2)) + (n_layers if mm.group(1) == "dspark" else 0)
                        pat = "layer.{l}." + mm.group(3)
                        return (1, L, tab_index.get(pat, 999), name)
                    if name.startswith("dspark."):
                        # main_hidden/main_x belong to the forward, draft taps after the stages
                        # main_hidden/main_x close the forward (after the head), draft taps follow
                        return (2 if name in ("dspark.main_hidden", "dspark.main_x") else 3, 0, tab_index.get(name, 999), name)
                    t = tab_index.get(name, 999)
                    return (0 if t < tab_index.get("layer.{l}.engram.out", 3) else 2, 0, t, name)
                items.sort(key=key)
                for order, (name, arr, kind, layer) in enumerate(items):
                    w.write(k, name, arr, kind=kind, layer=layer, order=order)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("golden")
    ap.add_argument("out")
    ap.add_argument("--taps-json")
    ap.add_argument("--v41", help="path of the v41 binary (runs `v41 taps --json`)")
    ap.add_argument("--prompts", help="also write the prompts as a --prompt-ids file")
    args = ap.parse_args()
    try:
        table = load_table(args)
    except (OSError, subprocess.CalledProcessError, ValueError) as e:
        sys.stderr.write("golden_to_v41: cannot get the tap table (%s); pass --v41 PATH or --taps-json FILE\n" % e)
        return 2
    try:
        return convert(args.golden, args.out, table, args.prompts)
    except (OSError, KeyError) as e:
        sys.stderr.write("golden_to_v41: %s: %s\n" % (args.golden, e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
