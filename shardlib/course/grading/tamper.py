"""Tampering one kernel cannot prevent, detected: what the checks depend on, verified after every cell.

A learner's cell runs in the same interpreter as the checks, so it can change what they rely on:
silence errors (`get_ipython().showtraceback = ...`), rewrite cells before they run (input or AST
transformers, event callbacks), replace a function a check calls (`torch.allclose`, `shardlib.launch`,
a helper from a locked cell, a builtin such as `all`), or the kernel's own machinery (how it runs a
cell and sends its reply). After every cell the grader runs its own code in the kernel (REQUEST,
sent fresh each time, never a cell of the notebook; once after consecutive released cells that do not
call the learner's code, see Verifier.can_wait) that fingerprints all of this: identity, and for
Python functions their code, globals and defaults. The grader compares the fingerprints outside the
kernel, with

    a baseline taken before the notebook's first cell, after importing what the released cells import
        for the kernel's machinery, builtins, builtin types, torch.Tensor, and every name the released
        cells import (and the attributes the checks and locked cells use through it: torch.allclose)
    the state right after the released cell that bound it
        for every other name a released (locked or check) cell binds and the checks or locked cells use

A released cell that does not call the learner's code may change the machinery (the baseline moves
on); a learner's cell, a check, or a released cell that calls the learner's code (a "try it" cell)
may change none of it. Any change is tampering: the notebook is reported
as tampered and every check scores 0. What this cannot see is written in INSTRUCTORS.md ("Grading").
"""

from __future__ import annotations

import ast
import builtins
import json
import re
import secrets
import symtable
from pathlib import Path

from shardlib.course.grading import probe

RESULT_NAME = "_shardlib_grader_state_now"
PROBE_SOURCE = Path(probe.__file__).read_text(encoding="utf-8")
REQUEST = """\
_shardlib_grader_probe = {{"__name__": "_shardlib_grader_probe"}}
exec(compile({source!r}, "<shardlib grader>", "exec"), _shardlib_grader_probe)
{result} = _shardlib_grader_probe["state"]({chains!r}, {data!r}, {nonce!r}, {roots!r}, {imports!r}, {released!r},
                                            {files!r})
del _shardlib_grader_probe
"""
BASELINE_ONLY = ("released files", "library roots")
NOT_COMPARED = ("nonce", "walked", "walk", "shadows", "bases", "library modules")


def python_source(cell_source: str) -> str:
    """A cell's text as Python (IPython magics turned into calls), or '' where it does not parse."""
    from IPython.core.inputtransformer2 import TransformerManager

    try:
        text = TransformerManager().transform_cell(cell_source)
        ast.parse(text)
        return text
    except (SyntaxError, ValueError):
        return ""


def top_level_bindings(source: str) -> tuple[set[str], set[str], list[str]]:
    """(names bound by imports, names bound otherwise, the import statements) at a cell's top level."""
    imported, other, statements = set(), set(), []
    try:
        table = symtable.symtable(source, "<cell>", "exec")
        tree = ast.parse(source)
    except SyntaxError:
        return imported, other, statements
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not (isinstance(node, ast.ImportFrom) and node.level):
            statements.append(ast.unparse(node))
    for symbol in table.get_symbols():
        if symbol.is_imported():
            imported.add(symbol.get_name())
        if symbol.is_assigned() or (symbol.is_namespace() and not symbol.is_imported()):
            other.add(symbol.get_name())
    return imported, other, statements


def assigned_data(source: str) -> set[str]:
    """Names a cell binds at its top level by assignment (not by import, def or class): its data."""
    try:
        table = symtable.symtable(source, "<cell>", "exec")
    except SyntaxError:
        return set()
    return {symbol.get_name() for symbol in table.get_symbols()
            if symbol.is_assigned() and not symbol.is_namespace() and not symbol.is_imported()}


def global_chains(source: str) -> set[str]:
    """Every dotted name (and its prefixes) a cell uses whose root is a global: `torch.testing.assert_close`."""
    try:
        tree, table = ast.parse(source), symtable.symtable(source, "<cell>", "exec")
    except SyntaxError:
        return set()
    globals_used = set()
    tables = [table]
    while tables:
        current = tables.pop()
        tables.extend(current.get_children())
        for symbol in current.get_symbols():
            if current.get_type() == "module" and symbol.is_referenced():
                globals_used.add(symbol.get_name())
            elif current.get_type() != "module" and symbol.is_global() and symbol.is_referenced():
                globals_used.add(symbol.get_name())
    chains = set()
    for node in ast.walk(tree):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in globals_used:
            parts.append(node.id)
            parts.reverse()
            chains.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
    return chains


# what a learner's cell may add to the event callbacks and display formatters: `%matplotlib inline`'s and
# `%load_ext autoreload`'s (functions of these modules, from the library's files; they cannot change a reply)
BENIGN_MODULES = ("matplotlib_inline.", "matplotlib.", "IPython.extensions.autoreload.", "IPython.core.pylabtools.")
FUNCTION = re.compile(r"function (\S+) in (\S+) ")


def only_benign_added(before: str, after: str, library_roots: list[str], new_modules=frozenset()) -> bool:
    """Whether a fingerprint list (event callbacks, a formatter's printers, sys.meta_path) only gained
    functions of BENIGN_MODULES from the library's files, or objects of a library module just imported."""
    def items(text: str) -> list[str] | None:
        try:
            found = ast.literal_eval(text.split(" ", 1)[1] if text[:1].isdigit() else text)
        except (IndexError, ValueError, SyntaxError):
            return None
        return found if isinstance(found, list) else None

    old, new = items(before), items(after)
    if old is None or new is None or not set(old) <= set(new):
        return False
    for item in set(new) - set(old):
        found, origin = FUNCTION.search(item), item.rpartition("|")[2]
        if origin in new_modules:
            continue  # the library's code, of a module just imported (its finder on sys.meta_path)
        if not (found and found[1].startswith(BENIGN_MODULES) and found[2].startswith(tuple(library_roots))):
            return False
    return True


class Verifier:
    """Built from the notebook as graded: [(index, role, source)] for its code cells; and the answer cells
    as released (their stubs: the names the learner is meant to define), default the answers in `cells`.
    Never the learner's own answers: a name they bind would escape the verification."""

    def __init__(self, cells: list[tuple[int, str, str]], released_answers: list[str] | None = None):
        released = [(i, role, python_source(src)) for i, role, src in cells if role in ("locked", "check")]
        self.released_sources = [src for _, role, src in cells if role in ("locked", "check")]
        # the release itself, answers untouched and nothing added: no code of the learner's runs at all
        self.untouched = released_answers is not None and not any(role == "learner" for _, role, _ in cells) and (
            [src for _, role, src in cells if role == "answer"] == [src for src in released_answers if src.strip()])
        if released_answers is None:
            released_answers = [src for _, role, src in cells if role == "answer"]
        answers = [python_source(src) for src in released_answers]
        answer_bound = set().union(*(set().union(*top_level_bindings(s)[:2]) for s in answers)) if answers else set()
        self.imported, self.assigned, self.bound_by, self.uses = set(), set(), {}, {}
        statements, chains, data = [], set(), set()
        self.calls_learner = set()  # released cells that use a name the answers define: they run learner code
        for index, _, source in released:
            used = {chain.split(".")[0] for chain in global_chains(source)}
            if used & answer_bound:
                self.calls_learner.add(index)
            imported, other, found = top_level_bindings(source)
            self.imported |= imported
            self.assigned |= other
            self.bound_by[index] = imported | other
            self.uses[index] = used | other
            data |= assigned_data(source)
            statements += found
            chains |= global_chains(source)
        self.import_only = self.imported - self.assigned
        bound = (self.imported | self.assigned) - answer_bound
        builtin_names = set(dir(builtins)) - self.imported - self.assigned - answer_bound
        self.chains = sorted(c for c in chains if c.split(".")[0] in bound | builtin_names)
        self.data_roots = sorted(data - answer_bound - self.imported)
        self.import_source = "\n".join(dict.fromkeys(statements))
        self.expected: dict[str, str] = {}
        self.walk: dict[str, dict[str, str]] = {}  # {module or class: {name: hash}}, what the walk reached
        self.shadows: dict[str, list[str]] = {}  # {module: its globals named like builtins}
        self.modules: set[str] = set()  # the library's modules loaded so far
        self.pristine: dict[str, str] = {}
        self.baseline: dict[str, str] = {}

    def request(self, baseline: bool = False) -> tuple[str, dict, str]:
        nonce = secrets.token_hex(8)
        code = REQUEST.format(source=PROBE_SOURCE, result=RESULT_NAME, chains=self.chains, data=self.data_roots,
                              nonce=nonce, roots=self.baseline.get("library roots"),
                              imports=self.import_source if baseline else None,
                              released=self.released_sources if baseline else [],
                              files=self.baseline.get("released files", []))
        return code, {"state": RESULT_NAME}, nonce

    @staticmethod
    def parse(run, nonce: str) -> dict | None:
        try:
            data = run.user_expressions["state"]["data"]["text/plain"]
            state = json.loads(ast.literal_eval(data))
        except (KeyError, TypeError, ValueError, SyntaxError):
            return None
        return state if isinstance(state, dict) and state.get("nonce") == nonce else None

    def start(self, state: dict) -> None:
        """The baseline, from the state taken before the notebook's first cell."""
        if state.get("audit guard") != "alive":
            raise RuntimeError(f"the grader's audit hook did not install in the kernel ({state.get('audit guard')})")
        self.baseline = {key: state[key] for key in BASELINE_ONLY if key in state}
        self.pristine = {key[len("pristine "):]: value for key, value in state.items() if key.startswith("pristine ")}
        self.expected = {key: value for key, value in state.items()
                         if not key.startswith(("pristine ", "name ", "wraps ", "nonce"))
                         and key not in (*BASELINE_ONLY, *NOT_COMPARED)}
        self.walk = {group: dict(names) for group, names in state.get("walk", {}).items()}
        self.modules = set(state.get("library modules", []))
        self.shadows = dict(state.get("shadows", {}))
        for key, value in state.items():
            if key.startswith("name ") and value.startswith("builtin"):
                self.expected[key] = value  # builtins the released cells use: never shadowed

    def runs_released_code_only(self, index: int, role: str) -> bool:
        """A released cell that does not call the learner's code; in an untouched release, every cell."""
        return self.untouched or (role == "locked" and index not in self.calls_learner)

    def can_wait(self, index: int, role: str, next_index: int, next_role: str) -> bool:
        """Whether the verification after cell `index` may be the one after the next cell: neither runs code
        of the learner's, so what changes across the two is the released cells' doing, and their data is
        still as they left it. (An untouched release is verified once, after its last cell.)"""
        return self.runs_released_code_only(index, role) and self.runs_released_code_only(next_index, next_role)

    def after(self, state: dict, index: int, role: str, covering=()) -> list[str]:
        """What changed that may not have, after cell `index` (its role) and the released cells whose
        verification waited for it (`covering`, see can_wait); the expectations moved on."""
        changed = []
        own = set().union(*(self.bound_by.get(i, set()) for i in (*covering, index)))
        uses = set().union(*(self.uses.get(i, set()) for i in (*covering, index)))
        if self.untouched:
            role = "locked"  # only the release's code ran: it may change the machinery (the baseline moves on)
        elif index in self.calls_learner:
            role = "check"  # a released cell that calls the learner's code may change no machinery either
        new_modules = set(state.get("library modules", [])) - self.modules  # imported by this cell (or under it)
        self.modules |= new_modules
        changed += self._walk_changes(state.get("walk", {}), state.get("bases", {}), new_modules,
                                      may_change=role == "locked")
        changed += self._shadowing(state.get("shadows", {}), may_change=role == "locked")
        for key, value in state.items():
            if key in NOT_COMPARED or key.startswith(("pristine ", "wraps ")):
                continue
            chain = key[len("name "):] if key.startswith("name ") else None
            root = chain.split(".")[0] if chain else key[len("data "):] if key.startswith("data ") else None
            if chain and root in self.import_only and value.startswith("user") and chain in self.pristine:
                if value != self.pristine[chain]:
                    if self._rewrapped(state, chain, self.pristine[chain]):
                        self.pristine[chain] = value
                    else:
                        changed.append(f"{chain} is not what `{self._import_of(root)}` gives")
                continue
            if root and (root in own or (key.startswith("data ") and role != "answer" and role != "learner"
                                         and root in uses)):
                self.expected[key] = value  # this released cell (re)bound it, or may have changed what it uses
                continue
            if key not in self.expected:
                if (chain is None and role == "locked") or key.startswith("data "):
                    self.expected[key] = value
                continue
            if value != self.expected[key]:
                if key.startswith(("list ", "printers ")) and only_benign_added(
                        self.expected[key], value, self.baseline.get("library roots", []), new_modules):
                    self.expected[key] = value  # `%matplotlib inline`, `%load_ext autoreload` in a learner's cell
                    continue
                if role == "locked" and chain is None and not key.startswith(("data ", "canaries", "audit guard")):
                    self.expected[key] = value  # a released cell may change the machinery
                elif chain and self._rewrapped(state, chain, self.expected[key]):
                    self.expected[key] = value
                elif not (chain and value == "unbound"):  # a deleted name fails the check by itself
                    changed.append(self._describe(key, chain, root, value))
        if state.get("walked") == "limit" and self.expected.get("walked") != "limit":
            changed.append(f"the grader's walk reached its limit of {probe.WALK_LIMIT} objects")
        if role != "locked":
            gone = [key for key in self.expected if key not in state and not key.startswith(("data ", "name "))]
            changed += [f"{key} is gone" for key in gone[:5]]
        return changed

    @staticmethod
    def _rewrapped(state: dict, chain: str, before: str) -> bool:
        """Whether `chain` now names a library's wrapper closing over the very object it named (`before`):
        torch._dynamo, first imported by torch.optim or torch.profiler, rebinds torch.manual_seed so, maybe
        cells before the notebook binds `torch` (probe.Fingerprints.decorated). The library's decorator, not
        the notebook's; what it wraps is what the checks were given."""
        wraps = state.get("wraps " + chain)
        return wraps is not None and before.partition(" ")[2] == wraps

    def _walk_changes(self, walk: dict, bases: dict, new_modules: set[str], may_change: bool) -> list[str]:
        """What the walk reached that changed. New names are a library's lazy attributes, unless they shadow
        a builtin in a module or add code to a class reached before (other than what it inherits anyway);
        names no longer reached are not missed. Code of a library module this very cell imported, or the
        library's wrapper around what was there, is a library's doing (transformers adds Module.smart_apply,
        torch._dynamo wraps torch.manual_seed)."""
        changed = []
        for group, names in walk.items():
            first_reached = group not in self.walk  # a module or class reached now (imported, used) for the first time
            known = self.walk.setdefault(group, {})
            for name, value in names.items():
                _, origin, wraps = value.split("|")
                by_import = origin in new_modules  # the library's code, of a module this cell imported
                if name in known and origin and wraps == known[name].split("|")[0]:
                    by_import = True  # a library's decorator around what was there (torch._dynamo: manual_seed)
                if name not in known:
                    inherited = next((self.walk[base][name] for base in bases.get(group, [])
                                      if name in self.walk.get(base, {})), None)
                    same = inherited is not None and value.partition("|")[0] == inherited.partition("|")[0]
                    if not (may_change or first_reached or by_import or same) and group.startswith("class "):
                        changed.append(f"{group.removeprefix('class ')}.{name} was added")
                    elif not same:
                        known[name] = value
                elif known[name] != value:
                    if may_change or by_import:
                        known[name] = value
                    else:
                        changed.append(f"{group.removeprefix('module ').removeprefix('class ')}.{name} was changed")
        return changed

    def _shadowing(self, shadows: dict, may_change: bool) -> list[str]:
        """Globals named like a builtin that a module reached before did not have: they shadow the builtin."""
        changed = []
        for module, names in shadows.items():
            if module in self.shadows and module != "builtins":
                added = sorted(set(names) - set(self.shadows[module]))
                if added and not may_change:
                    changed += [f"{module}.{name} was added: it shadows the builtin" for name in added]
            if may_change or module not in self.shadows:
                self.shadows[module] = names
        return changed

    @staticmethod
    def _describe(key: str, chain: str | None, root: str | None, value: str = "") -> str:
        if chain:
            return f"{chain} was changed"
        if key.startswith("data "):
            return f"the data in `{root}` was changed"
        kind, _, what = key.partition(" ")
        said = {"canaries": "what the checks' primitives answer on known inputs changed (1.0 < 0.5, torch.equal, ...)",
                "lying types": f"a class of the notebook's can lie to what a check compares: {value}",
                "threads running notebook code": f"a thread runs the notebook's code: {value}",
                "env": "the environment's SHARDLIB_ or IPYKERNEL_ variables were changed",
                "audit guard": "the grader's audit hook is gone", "timer": f"an interval timer was armed ({what})",
                "signal": f"the handler of signal {what} was changed", "list": f"{what} was changed",
                "module": f"sys.modules[{what!r}] was replaced"}
        return said.get(key, said.get(kind, f"{key} was changed"))

    def _import_of(self, root: str) -> str:
        return next((line for line in self.import_source.splitlines() if root in line.replace(",", " ").split()),
                    f"import {root}")


def take_baseline(kernel, verifier: Verifier, timeout: float) -> None:
    """The baseline, before the notebook's first cell; RuntimeError when it cannot be taken."""
    code, expressions, nonce = verifier.request(baseline=True)
    run = kernel.run(code, timeout, silent=True, user_expressions=expressions)
    state = verifier.parse(run, nonce)
    if state is None:
        detail = f"{run.ename}: {str(run.evalue)[:300]}" if run.ename else "no state"
        raise RuntimeError(f"the grader could not take its baseline in the kernel ({run.status}: {detail})")
    verifier.start(state)


def verify(kernel, verifier: Verifier, index: int, role: str, timeout: float, covering=()) -> list[str] | None:
    """What changed after cell `index` and the cells `covering` before it whose verification waited for it
    (kernel.Kernel's anomalies included); None when the kernel died."""
    code, expressions, nonce = verifier.request()
    run = kernel.run(code, timeout, silent=True, user_expressions=expressions)
    state = verifier.parse(run, nonce)
    found = list(kernel.anomalies)
    if state is None and run.status == "died":
        return None
    if state is None:
        return found + [f"the grader's verification did not run after it ({run.status}"
                        + (f": {run.ename}" if run.ename else "") + ")"]
    return found + verifier.after(state, index, role, covering)
