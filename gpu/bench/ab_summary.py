#!/usr/bin/python3
# ab_summary.py: the A/B table of alternating benchmark passes (device_run.sh's `ab` step).
#   ab_summary.py [--json OUT] --a A1.json [A2.json ...] --b B1.json [B2.json ...]
# Each file is a `v41_gpu_bench --json` profile (schema v41-profile/1); A is the current tree, B
# the tree with the older files. For every op name that both sides measured: the median over the
# passes of each side's per-pass median time, the range of those per-pass medians, and the ratio
# A / B (below 1: A is faster). Only names present in every pass of both sides are compared; the
# others are listed. Exit 0, or 2 naming the file that is missing, unreadable or not a profile.
import json
import statistics
import sys


def die(msg):
    sys.stderr.write("ab_summary.py: %s\n" % msg)
    sys.exit(2)


def load(path):
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        die("%s: %s" % (path, e))
    ops = d.get("ops") if isinstance(d, dict) else None
    if not isinstance(ops, list):
        die("%s: not a v41_gpu_bench profile (no 'ops' list)" % path)
    out = {}
    for o in ops:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            die("%s: an op without a name" % path)
        t = o.get("median_s")
        if not isinstance(t, (int, float)) or not t > 0:
            die("%s: op %s has no positive median_s" % (path, o["name"]))
        out[o["name"]] = float(t)
    return out


def main(argv):
    side, files, jout = None, {"a": [], "b": []}, None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--a", "--b"):
            side = a[2]
        elif a == "--json":
            if i + 1 >= len(argv):
                die("--json needs a file")
            jout = argv[i + 1]
            i += 1
        elif a.startswith("--"):
            die("unknown option %s" % a)
        elif side is None:
            die("usage: ab_summary.py [--json OUT] --a A.json... --b B.json...")
        else:
            files[side].append(a)
        i += 1
    if not files["a"] or not files["b"]:
        die("usage: ab_summary.py [--json OUT] --a A.json... --b B.json...")
    runs = {s: [load(f) for f in files[s]] for s in "ab"}
    every = [set(r) for s in "ab" for r in runs[s]]
    common = set.intersection(*every)
    order = [n for n in runs["a"][0] if n in common]
    rows = []
    print("%-44s %12s %-21s %12s %-21s %7s" % ("op", "A median", "A range (us)", "B median", "B range (us)", "A/B"))
    for n in order:
        ta = [r[n] * 1e6 for r in runs["a"]]
        tb = [r[n] * 1e6 for r in runs["b"]]
        ma, mb = statistics.median(ta), statistics.median(tb)
        rows.append({"op": n, "a_us": ta, "b_us": tb, "a_median_us": ma, "b_median_us": mb, "ratio": ma / mb})
        print("%-44s %12.1f %-21s %12.1f %-21s %7.3f" % (n, ma, "%.1f-%.1f" % (min(ta), max(ta)), mb,
                                                       "%.1f-%.1f" % (min(tb), max(tb)), ma / mb))
    rest = sorted(set.union(*every) - common)
    if rest:
        print("not in every pass of both sides (not compared): " + ", ".join(rest))
    if jout:
        with open(jout, "w") as f:
            json.dump({"schema": "v41-ab-1", "a": files["a"], "b": files["b"], "ops": rows, "not_compared": rest}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
