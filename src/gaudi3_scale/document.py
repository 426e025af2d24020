"""A small report document: sections of paragraphs, tables, PNG images and bullet lists, rendered as Markdown and
as one self-contained HTML file (images inlined as data URIs, no external assets). Benchmark and cost reports share
it."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

__all__ = ["Block", "Image", "Section", "Table", "to_html", "to_markdown"]


@dataclass(frozen=True)
class Table:
    headers: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class Image:
    path: Path
    caption: str


Block: TypeAlias = str | Table | Image | list[str]  # paragraph, table, plot, bullet list
Section: TypeAlias = tuple[str, list[Block]]


def _md(text: str) -> str:
    escaped = html.escape(text, quote=False).replace("\n", " ").replace("\r", " ")
    for char in "\\`*_[]|$":  # $: GitHub reads $…$ as math
        escaped = escaped.replace(char, "\\" + char)
    return escaped


def to_markdown(title: str, sections: Sequence[Section]) -> str:
    lines = [f"# {_md(title)}", ""]
    for heading, blocks in sections:
        lines += [f"## {_md(heading)}", ""]
        for block in blocks:
            if isinstance(block, Table):
                lines.append("| " + " | ".join(map(_md, block.headers)) + " |")
                lines.append("|" + " --- |" * len(block.headers))
                lines += ["| " + " | ".join(map(_md, row)) + " |" for row in block.rows]
            elif isinstance(block, Image):
                lines.append(f"![{_md(block.caption)}]({block.path.name})")
            elif isinstance(block, list):
                lines += [f"- {_md(item)}" for item in block]
            else:
                lines.append(_md(block))
            lines.append("")
    return "\n".join(lines)


_CSS = (
    "body{font-family:system-ui,sans-serif;color:#222;margin:2rem auto;max-width:90rem;padding:0 1rem}"
    "table{border-collapse:collapse;margin:1rem 0;font-size:.9rem;font-variant-numeric:tabular-nums}"
    "th,td{border:1px solid #ccc;padding:.25rem .5rem;text-align:left}th{background:#f2f2f2}"
    "img{max-width:100%;display:block}figure{margin:1.5rem 0}figcaption{color:#555}"
)


def to_html(title: str, sections: Sequence[Section]) -> str:
    e = html.escape
    parts = ['<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">', f"<title>{e(title)}</title>",
             f"<style>{_CSS}</style>\n</head>\n<body>", f"<h1>{e(title)}</h1>"]  # fmt: skip
    for heading, blocks in sections:
        parts.append(f"<h2>{e(heading)}</h2>")
        for block in blocks:
            if isinstance(block, Table):
                head = "".join(f"<th>{e(h)}</th>" for h in block.headers)
                body = "".join(
                    "<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>\n" for row in block.rows
                )
                parts.append(f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>")
            elif isinstance(block, Image):
                data = base64.b64encode(block.path.read_bytes()).decode("ascii")
                parts.append(f'<figure><img src="data:image/png;base64,{data}" alt="{e(block.caption)}">'
                             f"<figcaption>{e(block.caption)}</figcaption></figure>")  # fmt: skip
            elif isinstance(block, list):
                parts.append("<ul>\n" + "".join(f"<li>{e(item)}</li>\n" for item in block) + "</ul>")
            else:
                parts.append(f"<p>{e(block)}</p>")
    parts.append("</body>\n</html>\n")
    return "\n".join(parts)
