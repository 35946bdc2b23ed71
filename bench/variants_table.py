#!/usr/bin/env python3
"""Side-by-side table of a bench/cuda_variants.sh log: one row per bench
case, one column per variant, the microseconds of each round.
Usage: variants_table.py variants.log"""
import collections
import re
import sys

rows, names, v = collections.OrderedDict(), [], None
for line in open(sys.argv[1]):
    m = re.match(r"===== (\S+) \(round", line)
    if m:
        v = m.group(1)
        if v not in names:
            names.append(v)
        continue
    m = re.match(r"(.*? B=\d+)\s+([\d.]+)\s", line)
    if v and m:
        rows.setdefault(m.group(1).strip(), collections.OrderedDict()).setdefault(v, []).append(float(m.group(2)))
print("%-56s" % "case (us per round)" + "".join("%16s" % n for n in names))
for case, r in rows.items():
    print("%-56s" % case + "".join("%16s" % "/".join("%.1f" % x for x in r.get(n, [])) for n in names))
