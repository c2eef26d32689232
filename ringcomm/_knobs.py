"""docs/configuration.md's environment section, made from the core's table of knobs
(csrc/common/knobs.cc, through ringcomm._C.knobs()).

    python -m ringcomm._knobs                              # print the section
    python -m ringcomm._knobs --write docs/configuration.md   # replace it between the markers
"""

from __future__ import annotations

import argparse
import sys

from . import _C

BEGIN = "<!-- knobs: begin (python -m ringcomm._knobs --write docs/configuration.md) -->"
END = "<!-- knobs: end -->"

_TYPES = {
    "int": "int",
    "size": "bytes",
    "flag": "flag",
    "switch": "0 or 1",
    "string": "string",
    "path": "path",
}


def _type(row: dict) -> str:
    if row["type"] == "enum":
        return ", ".join(row["values"])
    return _TYPES[row["type"]]


def _default(row: dict) -> str:
    text = row["default"]
    return (
        text[1:-1] if text.startswith("(") and text.endswith(")") else f"`{text}`" if text else ""
    )


def markdown() -> str:
    """The section: a table per group of knobs, in the table's order."""
    lines = []
    section = None
    for row in _C.knobs():
        if row["section"] != section:
            section = row["section"]
            lines += [
                "",
                f"### {section}",
                "",
                "| variable | type | default | meaning |",
                "|---|---|---|---|",
            ]
        lines.append(f"| `{row['name']}` | {_type(row)} | {_default(row)} | {row['doc']} |")
    return "\n".join(lines[1:]) + "\n"


def splice(page: str, section: str) -> str:
    """`page` with the text between its markers replaced by `section`."""
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[:start] + "\n" + section + page[end:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ringcomm._knobs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--write", metavar="FILE", help="replace the section between the markers")
    args = parser.parse_args(argv)
    if not args.write:
        sys.stdout.write(markdown())
        return 0
    with open(args.write) as f:
        page = f.read()
    with open(args.write, "w") as f:
        f.write(splice(page, markdown()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
