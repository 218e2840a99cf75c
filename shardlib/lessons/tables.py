"""A table a lesson generates from the library's own data, so that it can never disagree with it.

    Table(["key", "what it does"], [("stage", "0-3"), ...])   # the last expression of a cell: a table

In a notebook it shows as an HTML table (what JupyterLab and GitHub render of a saved output), elsewhere
as aligned text. `code` in backticks becomes code.
"""

from __future__ import annotations

import html
import re

__all__ = ["Table"]


def _cell_html(value) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(str(value), quote=False))


class Table:
    def __init__(self, header: list[str], rows: list[tuple]):
        if any(len(row) != len(header) for row in rows):
            raise ValueError(f"every row needs {len(header)} values, one per column of {header}")
        self.header, self.rows = list(header), [tuple(row) for row in rows]

    def _repr_html_(self) -> str:
        head = "".join(f"<th style=\"text-align:left\">{_cell_html(h)}</th>" for h in self.header)
        body = "".join("<tr>" + "".join(f"<td style=\"text-align:left\">{_cell_html(v)}</td>" for v in row) + "</tr>"
                       for row in self.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def __repr__(self) -> str:
        widths = [max(len(str(v)) for v in column) for column in zip(self.header, *self.rows)]
        lines = [self.header, ["-" * w for w in widths], *self.rows]
        return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines)
