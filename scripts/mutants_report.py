"""Summarise a mutmut run against the allow-list:  python scripts/mutants_report.py TREE ALLOWLIST

Reads TREE/mutants-results.txt (`mutmut results --all true`), prints a markdown table per
module (the one docs/testing.md carries) and every survivor that is not allow-listed, and
exits 1 if there is one. Allow-list lines: `<mutant name or fnmatch glob> <reason>`;
'#' starts a comment. "no tests" (no fast test reaches the function) and "suspicious" count
as survivors: a mutant the suite cannot see is one nothing protects.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

SURVIVING = {"survived", "no tests", "suspicious"}


def load_allowlist(path: Path) -> list[tuple[str, str]]:
    rules = []
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, reason = line.partition(" ")
        if not reason.strip():
            raise SystemExit(f"{path}: {name}: an allow-listed mutant needs a reason")
        rules.append((name, reason.strip()))
    return rules


def main(tree: str, allowlist: str) -> int:
    rules = load_allowlist(Path(allowlist))
    results = Path(tree) / "mutants-results.txt"
    by_module: dict[str, Counter] = defaultdict(Counter)
    unexplained = []
    for line in results.read_text().splitlines():
        m = re.match(r"\s*(\S+): (.+)$", line)
        if not m or "__mutmut_" not in m.group(1):
            continue
        name, status = m.group(1), m.group(2).strip()
        module = re.split(r"\.x(?:_|ǁ)", name)[0]
        c = by_module[module]
        c["mutants"] += 1
        if status in SURVIVING:
            if any(fnmatch.fnmatchcase(name, pat) for pat, _ in rules):
                c["allow-listed"] += 1
            else:
                c["survived"] += 1
                unexplained.append(f"{name}: {status}")
        elif status in ("killed", "timeout", "segfault", "caught by type check"):
            c["killed"] += 1
        else:
            c[status] += 1
    cols = ["mutants", "killed", "survived", "allow-listed"]
    print("| module | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    total: Counter = Counter()
    for module in sorted(by_module):
        total.update(by_module[module])
        print(f"| `{module}` | " + " | ".join(str(by_module[module][k]) for k in cols) + " |")
    print("| **total** | " + " | ".join(f"**{total[k]}**" for k in cols) + " |")
    other = {k: v for k, v in total.items() if k not in cols}
    if other:
        print(f"\nother statuses: {other}")
    if unexplained:
        print(f"\n{len(unexplained)} survivor(s) neither killed nor allow-listed:")
        print("\n".join("  " + u for u in unexplained))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
