"""``python -m streamplan.tools.catalogue``: the coverage table (see ``table.py``). Progress goes to stderr, one line
per class; the table to stdout, or as Markdown with ``--markdown [PATH]``."""
from __future__ import annotations

import argparse
import logging
import sys
import warnings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m streamplan.tools.catalogue", description=__doc__)
    p.add_argument("--only", default="", help="comma-separated class or case names (case-insensitive) to run")
    p.add_argument("--markdown", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the table as Markdown to PATH (stdout without one)")
    p.add_argument("--rows", type=int, default=None, help="rows per case call (default: table.ROWS per library)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("streamplan").setLevel(logging.WARNING)
    for name in ("transformers", "diffusers", "torch._export", "torch.export"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from . import table
    n = a.rows
    only = {s.strip() for s in a.only.split(",") if s.strip()} or None

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    rows = table.rows(only, None if a.quiet else progress, n)
    if a.markdown is None:
        print(table.render_text(rows))
    else:
        text = table.render_markdown(rows, n)
        if a.markdown == "-":
            sys.stdout.write(text)
        else:
            with open(a.markdown, "w") as f:
                f.write(text)
            print(f"wrote {a.markdown} ({len(rows)} rows)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
