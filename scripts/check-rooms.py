#!/usr/bin/env python3
"""Fails on an import circle between the modules of a crate, or a source file of more than
MAX_LINES lines outside its tests (rooms one can hold in one's head).

A circle is counted between siblings: modules with the same parent (the crate's top-level
modules, or the rooms of a folder such as router/src/backend/). A reference from anywhere
inside sibling A (its own submodules included) to anywhere inside sibling B is an edge
A -> B; a parent using its child, or a child using its parent, is not. Test modules
(after `#[cfg(test)]`) are left out: they are children that read their parent.

References read: `use` trees (`crate::`, `super::`, `self::`, and a child module's name),
and paths written inline (`crate::a::b`, `super::x`).

Usage: check-rooms.py [CRATE_DIR ...] (default: every workspace member's src/).
Exit status 1 when a circle or a long file is found, each printed.
`--self-test` first checks the checker on made-up crates (a circle it must find, through
a `use` group, `super::` and a folder's rooms; and the same crates without it).
"""

import os
import re
import sys

MAX_LINES = 700


def module_path(src, file):
    rel = os.path.relpath(file, src)[: -len(".rs")].split(os.sep)
    if rel[-1] in ("lib", "main") and len(rel) == 1:
        return ()
    if rel[-1] == "mod":
        rel = rel[:-1]
    return tuple(rel)


def strip_noise(text):
    """The file without its tests, comments and string literals."""
    cut = re.search(r"(?m)^#\[cfg\(test\)\]", text)
    if cut:
        text = text[: cut.start()]
    text = re.sub(r"(?s)/\*.*?\*/", "", text)
    text = re.sub(r'r#*"(?s:.*?)"#*', '""', text)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    return re.sub(r"(?m)//.*$", "", text)


def expand_use(tree):
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e']."""
    tree = re.sub(r"\s+as\s+\w+", "", tree)
    tree = re.sub(r"\s+", "", tree)
    depth, start = 0, None
    for i, ch in enumerate(tree):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                prefix, inner, rest = tree[:start], tree[start + 1 : i], tree[i + 1 :]
                parts, d, last = [], 0, 0
                for j, c in enumerate(inner):
                    d += c == "{"
                    d -= c == "}"
                    if c == "," and d == 0:
                        parts.append(inner[last:j])
                        last = j + 1
                parts.append(inner[last:])
                out = []
                for p in parts:
                    if p:
                        out += expand_use(prefix + p + rest)
                return out
    return [tree]


def resolve(path, here, modules):
    """The module an item path names, seen from module `here`; None outside the crate."""
    segs = [s for s in path.split("::") if s]
    if not segs:
        return None
    if segs[0] == "crate":
        base, segs = (), segs[1:]
    elif segs[0] in ("super", "self"):
        base = here
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                base = base[:-1]
            segs = segs[1:]
    elif here + (segs[0],) in modules:
        base = here
    else:
        return None
    target = base
    for s in segs:
        if target + (s,) in modules:
            target = target + (s,)
        else:
            break
    return target


def edges_of(src, files, modules):
    edges = {}
    for file in files:
        here = module_path(src, file)
        text = strip_noise(open(file, encoding="utf-8").read())
        paths = []
        for m in re.finditer(r"(?s)\buse\s+([^;]+);", text):
            paths += expand_use(m.group(1))
        paths += re.findall(r"\b(?:crate|super)(?:::\w+)+", text)
        for p in paths:
            target = resolve(p, here, modules)
            if target is None:
                continue
            n = 0
            while n < min(len(here), len(target)) and here[n] == target[n]:
                n += 1
            if n == len(here) or n == len(target):
                continue  # the same module, an ancestor or a descendant
            a, b = here[: n + 1], target[: n + 1]
            edges.setdefault(a, {}).setdefault(b, []).append(f"{os.path.relpath(file)}: {p}")
    return edges


def circles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def check(crate, quiet=False):
    src = os.path.join(crate, "src")
    files = [
        os.path.join(d, f)
        for d, _, fs in os.walk(src)
        for f in fs
        if f.endswith(".rs")
    ]
    long = []
    for f in sorted(files):
        text = open(f, encoding="utf-8").read()
        cut = re.search(r"(?m)^#\[cfg\(test\)\]", text)
        lines = text[: cut.start() if cut else len(text)].count("\n")
        if lines > MAX_LINES:
            long.append(f"{os.path.relpath(f)}: {lines} lines outside its tests")
    if not quiet:
        for why in long:
            print(f"{crate}: over {MAX_LINES} lines: {why}")
    modules = {module_path(src, f) for f in files}
    edges = edges_of(src, files, modules)
    found = circles(edges)
    for comp in [] if quiet else found:
        names = ", ".join("::".join(m) for m in comp)
        print(f"{crate}: an import circle between {names}:")
        for a in comp:
            for b in comp:
                for why in edges.get(a, {}).get(b, [])[:3]:
                    print(f"  {'::'.join(a)} -> {'::'.join(b)} ({why})")
    return not found and not long


def members():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    text = open(os.path.join(root, "Cargo.toml"), encoding="utf-8").read()
    listed = re.search(r"members\s*=\s*\[([^\]]*)\]", text).group(1)
    return [os.path.join(root, m) for m in re.findall(r'"([^"]+)"', listed)]


def self_test():
    import shutil
    import tempfile

    def crate(files):
        d = tempfile.mkdtemp()
        for path, text in files.items():
            full = os.path.join(d, "src", path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            open(full, "w", encoding="utf-8").write(text)
        return d

    base = {
        "lib.rs": "mod a;\nmod b;\nmod room;\n",
        "a.rs": "use crate::{b::{B, C as D}, room};\n",
        "room/mod.rs": "mod x;\nmod y;\nuse x::X;\npub struct R;\n",
        "room/x.rs": "use super::R;\nuse super::y::Y;\npub struct X;\n",
        "room/y.rs": "pub struct Y;\n#[cfg(test)]\nmod tests { use super::super::x::X; }\n",
        "b.rs": "pub struct B;\n// crate::a::A in a comment\nconst S: &str = \"crate::a\";\n",
    }
    cases = [
        (base, True),
        ({**base, "b.rs": "pub struct B;\nfn f() { crate::a::g() }\n"}, False),
        ({**base, "room/y.rs": "use super::{x::X, R};\npub struct Y;\n"}, False),
        ({**base, "b.rs": "pub struct B;\n" * (MAX_LINES + 1)}, False),
        ({**base, "b.rs": "pub struct B;\n#[cfg(test)]\n" + "//\n" * MAX_LINES}, True),
    ]
    for files, clean in cases:
        d = crate(files)
        found_none = check(d, quiet=True)
        shutil.rmtree(d)
        if found_none != clean:
            print(f"self-test failed: expected {'no ' if clean else ''}circle in {files}")
            sys.exit(2)
    print("self-test: the checker finds the circles and long files it should, and no other")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--self-test"]:
        self_test()
        args = args[1:]
    crates = args or members()
    ok = all([check(os.path.normpath(c)) for c in crates])
    if ok:
        print(f"no import circle and no file over {MAX_LINES} lines in {len(crates)} crates")
    sys.exit(0 if ok else 1)
