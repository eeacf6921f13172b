"""`moestream archs`: the supported model families."""

from __future__ import annotations


def add_parser(sub) -> None:
    archs = sub.add_parser("archs", help="list supported model families")
    archs.set_defaults(func=run)


WIDTH = 100   # the table fits a terminal of this many columns: long cells wrap within their column


def run(args) -> int:
    from moestream.archs import describe_archs

    print(table(describe_archs()))
    return 0


def table(rows: list[dict[str, str]], width: int = WIDTH) -> str:
    """Rows as columns: the widest column gives up a character at a time until the table fits
    `width`, its cells wrapped onto further lines of their row (the first column never wraps)."""
    import textwrap

    cols = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    floor = {c: max(len(c), *(len(w) for r in rows for w in r[c].split())) for c in cols}
    floor[cols[0]] = widths[cols[0]]
    while sum(widths.values()) + 2 * (len(cols) - 1) > width:
        shrinkable = [c for c in cols if widths[c] > floor[c]]
        if not shrinkable:
            break
        widest = max(shrinkable, key=lambda c: widths[c])
        widths[widest] -= 1

    def line(cells: dict[str, str]) -> str:
        return "  ".join(cells[c].ljust(widths[c]) for c in cols).rstrip()

    out = [line({c: c for c in cols}), line({c: "-" * widths[c] for c in cols})]
    for r in rows:
        wrapped = {c: textwrap.wrap(r[c], widths[c]) or [""] for c in cols}
        for i in range(max(len(w) for w in wrapped.values())):
            out.append(line({c: wrapped[c][i] if i < len(wrapped[c]) else "" for c in cols}))
    return "\n".join(out)
