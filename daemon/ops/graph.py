"""Draw a definition (as `definition_to_dict` describes it) as a Mermaid or Graphviz diagram.

Given a workflow's state, the diagram also shows where each thread is and which waits are armed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from daemon.core.state import MAIN_THREAD, EventStatus, State, ThreadStatus, WorkflowStatus

FORMATS = ("mermaid", "dot", "svg")

_EVENT_MARK = {
    EventStatus.SETUP: "armed",
    EventStatus.PENDING_SETUP: "pending",
    EventStatus.SETUP_ERROR: "error",
    EventStatus.TEARDOWN_ERROR: "error",
}
#: Per node shape: Mermaid's brackets and Graphviz's shape.
_SHAPES = {
    "step": ('["', '"]', "box"),
    "decision": ('{"', '"}', "diamond"),
    "branch": ('(["', '"])', "box"),
    "loop": ('{{"', '"}}', "hexagon"),
    "wait": ('[/"', '"/]', "parallelogram"),
    "event": ('>"', '"]', "cds"),
    "wait_for": ('[\\"', '"/]', "trapezium"),
    "go": ('[["', '"]]', "component"),
    "start": ('(("', '"))', "circle"),
    "end": ('(("', '"))', "doublecircle"),
    "note": ('[/"', '"\\]', "note"),
}
#: Per mark: Mermaid style and Graphviz fill and border colours.
_MARKS = {
    "here": ("fill:#fde68a,stroke:#b45309,stroke-width:3px", "#fde68a", "#b45309"),
    "failed": ("fill:#fecaca,stroke:#b91c1c,stroke-width:3px", "#fecaca", "#b91c1c"),
    "armed": ("fill:#bfdbfe,stroke:#1d4ed8,stroke-width:2px", "#bfdbfe", "#1d4ed8"),
    "pending": ("fill:#e5e7eb,stroke:#1d4ed8,stroke-dasharray:4", "#e5e7eb", "#1d4ed8"),
    "error": ("fill:#fecaca,stroke:#b91c1c,stroke-width:2px", "#fecaca", "#b91c1c"),
    "note": ("fill:#fffbeb,stroke:#b45309", "#fffbeb", "#b45309"),
}


@dataclass(slots=True)
class _Node:
    id: str
    lines: list[str]
    shape: str
    cluster: str
    mark: str = ""


class _Exit(NamedTuple):
    """A loose end: control leaves `src` along an edge labelled `label`."""

    src: str
    label: str = ""
    dotted: bool = False


@dataclass
class _Graph:
    nodes: list[_Node] = field(default_factory=list)
    edges: list[tuple[str, str, str, bool]] = field(default_factory=list)
    #: Statement (and event) name -> node id: names are unique within a definition.
    named: dict[str, str] = field(default_factory=dict)
    #: Thread name -> (start node, end node).
    threads: dict[str, tuple[str, str]] = field(default_factory=dict)
    cluster: str = ""

    def node(self, label: str, shape: str, name: str | None = None) -> str:
        nid = f"n{len(self.nodes)}"
        self.nodes.append(_Node(nid, [label], shape, self.cluster))
        if name is not None:
            self.named.setdefault(name, nid)
        return nid

    def link(self, exits: list[_Exit], dst: str) -> None:
        self.edges.extend((e.src, dst, e.label, e.dotted) for e in exits)


class _Builder:
    """Turns the statement tree into a control-flow graph, one subgraph per Go thread."""

    def __init__(self) -> None:
        self.g = _Graph()
        self.loops: list[tuple[str, list[_Exit]]] = []  # innermost last: head node, its breaks
        self.end = ""

    def thread(self, name: str, body: list[dict[str, Any]], into: list[_Exit]) -> None:
        saved = self.loops, self.end, self.g.cluster
        self.loops, self.g.cluster = [], "" if name == MAIN_THREAD else name
        if name == MAIN_THREAD:
            start = self.g.node("start", "start")
            into = [_Exit(start)]
        else:
            start = into[0].src
        self.end = self.g.node("end" if name == MAIN_THREAD else f"end {name}", "end")
        self.g.threads[name] = (start, self.end)
        self.g.link(self.block(body, into), self.end)
        self.loops, self.end, self.g.cluster = saved

    def block(self, stmts: list[dict[str, Any]], into: list[_Exit]) -> list[_Exit]:
        for s in stmts:
            into = self.stmt(s, into)
        return into

    def stmt(self, s: dict[str, Any], into: list[_Exit]) -> list[_Exit]:
        g, kind, name = self.g, s.get("type", "?"), s.get("name")
        if kind == "section":
            return self.block(s["children"], into)
        if kind in ("break", "continue", "return"):
            if kind == "return":
                g.link(into, self.end)
            elif self.loops and kind == "continue":
                g.link(into, self.loops[-1][0])
            elif self.loops:
                self.loops[-1][1].extend(into)
            return []
        labels = {"for": "for ", "wait": "wait ", "wait_for": "wait_for ", "go": "go "}
        shape = {"for": "loop", "if": "decision", "switch": "decision"}.get(kind, kind)
        n = g.node(
            labels.get(kind, "") + (name or kind), shape if shape in _SHAPES else "step", name
        )
        g.link(into, n)
        if kind in ("if", "switch"):
            exits: list[_Exit] = []
            for b in s["branches"]:
                bn = g.node(b["name"] + (" (default)" if b["default"] else ""), "branch", b["name"])
                g.edges.append((n, bn, "", False))
                exits += self.block(b["children"], [_Exit(bn)])
            if not any(b["default"] for b in s["branches"]):
                exits.append(_Exit(n, "none"))
            return exits
        if kind == "for":
            self.loops.append((n, []))
            g.link(self.block(s["children"], [_Exit(n, "loop")]), n)
            return [_Exit(n, "done"), *self.loops.pop()[1]]
        if kind == "wait":
            exits = []
            for c in s["cases"]:
                cn = g.node(f"{c['event']} · {c['handler']}", "event", c["event"])
                g.edges.append((n, cn, "", False))
                exits += self.block(c["children"], [_Exit(cn)])
            return exits
        if kind == "go" and name is not None:
            self.thread(name, s["children"], [_Exit(n, "starts", dotted=True)])
        return [_Exit(n)]


def _overlay(g: _Graph, state: State, failed_step: str) -> None:
    """Mark where each thread is, the step that failed, and the status of each wait event."""
    # Without the failing step, the failed workflow's positions are what is marked as failed.
    failed = state.status is WorkflowStatus.FAILED and failed_step not in g.named
    if state.status is WorkflowStatus.FAILED and not failed:
        _note(g, f"Failed: step {failed_step}", g.named[failed_step], "failed")
    if state.status is WorkflowStatus.FINISHED:
        _note(g, "Finished", g.threads[MAIN_THREAD][1], "here")
    for t in state.threads:
        if state.status is WorkflowStatus.FINISHED and t.id == MAIN_THREAD:
            continue
        where = g.named.get(t.cur_step) if t.cur_step else g.threads.get(t.name, ("", ""))[0]
        text = f"{t.id}: {t.status.value}"
        if t.status is ThreadStatus.RESUMING and t.cur_step:
            text += f" after {t.cur_step}"
        if t.cur_step and t.cur_step not in g.named:
            text += f" at {t.cur_step!r} (not in the definition)"
        _note(g, text, where, "failed" if failed else "here")
        for ev in t.wait_events:
            nid = g.named.get(ev.req.name)
            if nid is None:
                continue
            node = g.nodes[int(nid[1:])]
            node.lines.append(f"[{ev.status.value}]" + (f" {ev.error}" if ev.error else ""))
            node.mark = _EVENT_MARK.get(ev.status, node.mark)


def _note(g: _Graph, text: str, where: str | None, mark: str) -> None:
    note = g.node(text, "note")
    g.nodes[-1].mark = "note"
    if where:
        g.edges.append((note, where, "", True))
        g.nodes[int(where[1:])].mark = mark


def render(
    tree: dict[str, Any],
    fmt: str = "mermaid",
    *,
    state: State | None = None,
    title: str = "",
    failed_step: str = "",
    children: dict[str, str] | None = None,
) -> str:
    """Return the diagram of a definition tree in `fmt` ("mermaid", "dot" or "svg").

    With a `state`, mark where each thread is (the position of a failed workflow is its last
    checkpoint: the step after it is usually `failed_step`) and the status of each wait.
    `children` maps a Child case's event to the text naming its child (id and status).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown graph format {fmt!r}; use one of {', '.join(FORMATS)}")
    b = _Builder()
    b.thread(MAIN_THREAD, tree.get("children", []), [])
    if state is not None:
        _overlay(b.g, state, failed_step)
    for event, text in (children or {}).items():
        nid = b.g.named.get(event)
        if nid is not None:
            b.g.nodes[int(nid[1:])].lines.append(text)
    if fmt == "svg":
        return _svg(b.g, title)
    return _mermaid(b.g, title) if fmt == "mermaid" else _dot(b.g, title)


def _clusters(g: _Graph) -> dict[str, list[_Node]]:
    by: dict[str, list[_Node]] = {}
    for n in g.nodes:
        by.setdefault(n.cluster, []).append(n)
    return by


def _mermaid(g: _Graph, title: str) -> str:
    def text(s: str) -> str:
        return s.replace('"', "#quot;")

    out = [f"---\ntitle: {text(title)}\n---"] if title else []
    out.append("flowchart TD")
    for i, (cluster, nodes) in enumerate(_clusters(g).items()):
        indent = "    " if cluster else "  "
        if cluster:
            out.append(f'  subgraph t{i}["thread {text(cluster)}"]')
        for n in nodes:
            left, right, _ = _SHAPES[n.shape]
            out.append(f"{indent}{n.id}{left}{'<br/>'.join(map(text, n.lines))}{right}")
        if cluster:
            out.append("  end")
    for src, dst, label, dotted in g.edges:
        arrow = "-.->" if dotted else "-->"
        tag = f"|{text(label)}|" if label else ""
        out.append(f"  {src} {arrow}{tag} {dst}")
    marks = sorted({n.mark for n in g.nodes if n.mark})
    out += [f"  classDef {m} {_MARKS[m][0]}" for m in marks]
    out += [f"  class {','.join(n.id for n in g.nodes if n.mark == m)} {m}" for m in marks]
    return "\n".join(out) + "\n"


def _dot(g: _Graph, title: str) -> str:
    def text(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    def attrs(n: _Node) -> str:
        a = [f"label={text(chr(10).join(n.lines))}", f"shape={_SHAPES[n.shape][2]}"]
        styles = ["rounded"] if n.shape == "branch" else []
        if n.mark:
            _, fill, stroke = _MARKS[n.mark]
            styles.append("filled")
            a += [f'fillcolor="{fill}"', f'color="{stroke}"']
            a += ["penwidth=2"] if n.mark in ("here", "failed", "armed") else []
        if styles:
            a.append(f'style="{",".join(styles)}"')
        return ", ".join(a)

    out = ["digraph workflow {", '  node [fontname="Helvetica"];', '  edge [fontname="Helvetica"];']
    if title:
        out.append(f"  label={text(title)}; labelloc=t;")
    for i, (cluster, nodes) in enumerate(_clusters(g).items()):
        indent = "    " if cluster else "  "
        if cluster:
            out += [f"  subgraph cluster_{i} {{", f"    label={text('thread ' + cluster)};"]
        out += [f"{indent}{n.id} [{attrs(n)}];" for n in nodes]
        if cluster:
            out.append("  }")
    for src, dst, label, dotted in g.edges:
        a = ([f"label={text(label)}"] if label else []) + (["style=dashed"] if dotted else [])
        tail = f" [{', '.join(a)}]" if a else ""
        out.append(f"  {src} -> {dst}{tail};")
    out.append("}")
    return "\n".join(out) + "\n"


#: The SVG layout: node width, line height, gaps; one column per thread, one row per node.
_W, _LINE, _GAP, _COL, _NOTE_W = 230, 16, 22, 320, 190


def _svg(g: _Graph, title: str) -> str:
    """Draw the graph as SVG without Graphviz: nodes top-down in definition order.

    Each node is a `<g class="node SHAPE MARK">` carrying `data-name` (the statement or event
    name), so a page can find and style the current position.
    """
    from html import escape

    names = {nid: name for name, nid in g.named.items()}
    columns = {c: i for i, c in enumerate(_clusters(g))}
    pos: dict[str, tuple[float, float, float, float]] = {}  # id -> x, y, w, h
    y = 50.0 if title else 20.0
    notes = [n for n in g.nodes if n.mark == "note" or n.shape == "note"]
    # A thread's end node is made before its body; it is drawn after it, the main one last.
    body = [n for n in g.nodes if n not in notes and n.shape != "end"]
    ends = sorted((n for n in g.nodes if n.shape == "end"), key=lambda n: n.cluster == "")
    for n in [*body, *ends]:
        h = 14.0 + _LINE * len(n.lines)
        pos[n.id] = (60.0 + columns[n.cluster] * _COL, y, float(_W), h)
        y += h + _GAP
    note_ids = {m.id for m in notes}
    targets = {src: dst for src, dst, _, dotted in g.edges if dotted and src in note_ids}
    stacked: dict[str, float] = {}
    for n in notes:
        h = 14.0 + _LINE * len(n.lines)
        at = pos.get(targets.get(n.id, ""))
        x, ny = (at[0] + _W + 40, at[1]) if at else (60.0, y)
        ny += stacked.get(targets.get(n.id, ""), 0.0)
        stacked[targets.get(n.id, "")] = stacked.get(targets.get(n.id, ""), 0.0) + h + 6
        if not at:
            y += h + _GAP
        pos[n.id] = (x, ny, float(_NOTE_W), h)
    width = max((x + w for x, _, w, _ in pos.values()), default=100) + 40
    height = max((yy + h for _, yy, _, h in pos.values()), default=40) + 20
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="workflow-graph" width="{width:.0f}"'
        f' height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}"'
        ' font-family="sans-serif" font-size="12">'
    )
    arrow = (
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5"'
        ' markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
        '<path d="M 0 0 L 10 5 L 0 10 z" fill="#555"/></marker></defs>'
    )
    out = [head, arrow]
    if title:
        out.append(f'<text x="20" y="26" font-size="15" font-weight="bold">{escape(title)}</text>')
    for src, dst, label, dotted in g.edges:
        if src not in pos or dst not in pos:
            continue
        sx, sy, sw, sh = pos[src]
        dx, dy, dw, _ = pos[dst]
        dash = ' stroke-dasharray="5,4"' if dotted else ""
        if src in note_ids:
            d = f"M {sx:.0f} {sy + sh / 2:.0f} L {dx + dw:.0f} {dy + 12:.0f}"
        elif dy > sy:
            d = f"M {sx + sw / 2:.0f} {sy + sh:.0f} L {dx + dw / 2:.0f} {dy:.0f}"
        else:  # a loop back up: around the left side
            d = (
                f"M {sx:.0f} {sy + sh / 2:.0f} C {sx - 40:.0f} {sy + sh / 2:.0f},"
                f" {dx - 40:.0f} {dy + 12:.0f}, {dx:.0f} {dy + 12:.0f}"
            )
        out.append(
            f'<path class="edge" d="{d}" fill="none" stroke="#555"{dash} marker-end="url(#arrow)"/>'
        )
        if label and dy > sy:
            mx, my = (sx + sw / 2 + dx + dw / 2) / 2 + 4, (sy + sh + dy) / 2 + 4
            out.append(f'<text class="edge-label" x="{mx:.0f}" y="{my:.0f}">{escape(label)}</text>')
    for n in g.nodes:
        x, ny, width_n, h = pos[n.id]
        fill, stroke = ("#ffffff", "#555") if not n.mark else _MARKS[n.mark][1:]
        thick = 3.0 if n.mark in ("here", "failed") else 1.5
        rx = 18 if n.shape in ("start", "end") else 10 if n.shape == "branch" else 3
        name = escape(names.get(n.id, ""), quote=True)
        classes = " ".join(c for c in ("node", n.shape, n.mark) if c)
        out.append(f'<g class="{classes}" data-id="{n.id}" data-name="{name}">')
        out.append(
            f'<rect x="{x:.0f}" y="{ny:.0f}" width="{width_n:.0f}" height="{h:.0f}" rx="{rx}" fill="{fill}"'
            f' stroke="{stroke}" stroke-width="{thick}"/>'
        )
        for i, line in enumerate(n.lines):
            ty = ny + 7 + _LINE * (i + 1) - 3
            out.append(f'<text x="{x + 8:.0f}" y="{ty:.0f}">{escape(line)}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"
