"""`moestream archs`: the supported model families."""

from __future__ import annotations


def add_parser(sub) -> None:
    archs = sub.add_parser("archs", help="list supported model families")
    archs.set_defaults(func=run)


def run(args) -> int:
    from moestream.archs import describe_archs

    rows = describe_archs()
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    print("  ".join("-" * widths[c] for c in cols))
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in cols))
    return 0

