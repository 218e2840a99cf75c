"""Tampering one kernel cannot prevent, detected: what the checks depend on, verified after every cell.

A learner's cell runs in the same interpreter as the checks, so it can change what they rely on:
silence errors (`get_ipython().showtraceback = ...`), rewrite cells before they run (input or AST
transformers, event callbacks), replace a function a check calls (`torch.allclose`, `shardlib.launch`,
a helper from a locked cell, a builtin such as `all`), or the kernel's own machinery (how it runs a
cell and sends its reply). After every cell the grader runs its own code in the kernel (STATE_CODE,
sent fresh each time, never a cell of the notebook) that fingerprints all of this: identity, and for
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
import secrets
import symtable

RESULT_NAME = "_shardlib_grader_state_now"
STATE_CODE = r'''
def _shardlib_grader_state(chains, import_source, nonce):
    import builtins, hashlib, inspect, json, sys, threading, types
    static = inspect.getattr_static
    values = (int, float, complex, str, bytes, bool, type(None), tuple, frozenset, range)

    def digest(code):
        h, stack = hashlib.sha256(), [code]
        while stack:
            c = stack.pop()
            h.update(c.co_code + repr((c.co_names, c.co_varnames, c.co_freevars)).encode())
            for k in c.co_consts:
                stack.append(k) if isinstance(k, types.CodeType) else h.update(repr(k)[:200].encode())
        return h.hexdigest()[:16]

    def fp(obj):
        kind = type(obj).__module__ + "." + type(obj).__qualname__
        if isinstance(obj, types.MethodType):
            return "method of %d: %s" % (id(obj.__self__), fp(obj.__func__))
        if isinstance(obj, (staticmethod, classmethod)):
            return kind + ": " + fp(obj.__func__)
        if isinstance(obj, property):
            return "property %s %s %s" % (fp(obj.fget), fp(obj.fset), fp(obj.fdel))
        if isinstance(obj, types.FunctionType):
            return "function %s.%s %d code %s globals %d defaults %.200r %.200r" % (
                obj.__module__, obj.__qualname__, id(obj), digest(obj.__code__), id(obj.__globals__),
                obj.__defaults__, obj.__kwdefaults__)
        if isinstance(obj, values):
            return "%s %d %s" % (kind, id(obj), hashlib.sha256(repr(obj).encode()).hexdigest()[:16])
        return "%s %d" % (kind, id(obj))

    def resolve(ns, chain):
        parts = chain.split(".")
        if parts[0] in ns:
            obj, where = ns[parts[0]], "user"
        elif hasattr(builtins, parts[0]):
            obj, where = getattr(builtins, parts[0]), "builtin"
        else:
            return "unbound"
        for attr in parts[1:]:
            if not isinstance(obj, (types.ModuleType, type)):
                return where + " instance"
            try:
                obj = static(obj, attr) if isinstance(obj, type) else getattr(obj, attr)
            except AttributeError:
                return where + " absent"
        return where + " " + fp(obj)

    private = {}
    if import_source is not None:  # the baseline: first import what the released cells import
        exec(import_source, private)
        if "torch" in sys.modules:  # torch rebinds torch.manual_seed when torch._dynamo is first imported (lazily,
            import torch._dynamo  # by torch.optim, torch.profiler or shardlib.launch): its own change, not tampering
    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    out = {"nonce": nonce}
    owners = {"shell": shell, "kernel": kernel, "session": getattr(kernel, "session", None),
              "compiler": getattr(shell, "compile", None), "displayhook": getattr(shell, "displayhook", None),
              "transformer manager": getattr(shell, "input_transformer_manager", None),
              "prefilter": getattr(shell, "prefilter_manager", None), "events": getattr(shell, "events", None)}
    for label, owner in owners.items():
        if owner is None:
            continue
        for cls in type(owner).__mro__:  # a base class patched is as good as the class itself
            for name, value in list(vars(cls).items()):
                if callable(value) or isinstance(value, (staticmethod, classmethod, property)):
                    out["%s %s.%s" % (label, cls.__qualname__, name)] = fp(value)
        for name in dir(owner):  # what a lookup on the object finds: an attribute set on it shadows its class's
            try:
                value = static(owner, name)
            except AttributeError:
                continue
            if callable(value) or isinstance(value, (staticmethod, classmethod, property)):
                out["%s.%s" % (label, name)] = fp(value)
    manager, prefilter = owners["transformer manager"], owners["prefilter"]
    lists = {"input_transformers_cleanup": shell.input_transformers_cleanup, "ast_transformers": shell.ast_transformers,
             "input_transformers_post": shell.input_transformers_post,
             "cleanup_transforms": getattr(manager, "cleanup_transforms", []),
             "line_transforms": getattr(manager, "line_transforms", []),
             "token_transformers": getattr(manager, "token_transformers", []),
             "prefilter transformers": getattr(prefilter, "transformers", []),
             "prefilter checkers": getattr(prefilter, "checkers", [])}
    lists.update(("event " + name, callbacks) for name, callbacks in shell.events.callbacks.items())
    for label, items in lists.items():
        out["list " + label] = "%d %s" % (id(items), [fp(item) for item in items])
    hooks = {"sys.excepthook": sys.excepthook, "sys.displayhook": sys.displayhook, "sys.gettrace()": sys.gettrace(),
             "sys.getprofile()": sys.getprofile(), "sys.breakpointhook": sys.breakpointhook,
             "threading trace": getattr(threading, "_trace_hook", None),
             "threading profile": getattr(threading, "_profile_hook", None),
             "shell.custom_exceptions": shell.custom_exceptions, "shell.CustomTB": getattr(shell, "CustomTB", None),
             "shell.user_ns": shell.user_ns, "shell.user_global_ns": shell.user_global_ns,
             "sys.modules": sys.modules, "builtins": sys.modules.get("builtins")}
    for label, value in hooks.items():
        out[label] = fp(value)
    for name in ("shell_handlers", "control_handlers"):
        for kind, handler in dict(getattr(kernel, name, None) or {}).items():
            out["kernel.%s[%s]" % (name, kind)] = fp(handler)
    if hasattr(sys, "monitoring"):
        for tool in range(6):
            out["sys.monitoring tool %d" % tool] = repr(sys.monitoring.get_tool(tool))
    for name, value in vars(builtins).items():
        if name not in ("_", "__", "___"):
            out["builtins." + name] = fp(value)
    classes = [int, float, bool, str, bytes, list, tuple, dict, set, frozenset, object, type, BaseException,
               Exception, AssertionError]
    torch = sys.modules.get("torch")
    if torch is not None:
        classes += [torch.Tensor, torch._C.TensorBase]
    for cls in classes:
        for name in dir(cls):
            try:
                out["class %s.%s.%s" % (cls.__module__, cls.__qualname__, name)] = fp(static(cls, name))
            except AttributeError:
                pass
    for chain in chains:
        out["name " + chain] = resolve(shell.user_ns, chain)
    for chain in chains:
        if chain.split(".")[0] in private:
            out["pristine " + chain] = resolve(private, chain)
    return json.dumps(out)
'''


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


# event callbacks a learner's cell may add: the inline backend's and autoreload's (they cannot change a reply)
BENIGN_CALLBACKS = ("function matplotlib_inline.", "function matplotlib.", "function IPython.extensions.autoreload.")


def only_benign_added(before: str, after: str) -> bool:
    """Whether an event's callbacks (a fingerprint list) only gained callbacks of BENIGN_CALLBACKS."""
    def items(text: str) -> list[str] | None:
        try:
            return ast.literal_eval(text.split(" ", 1)[1])
        except (IndexError, ValueError, SyntaxError):
            return None
    old, new = items(before), items(after)
    if old is None or new is None or new[:len(old)] != old:
        return False
    added = [item if item.startswith("function ") else item.split(": ", 1)[-1] for item in new[len(old):]]
    return all(item.startswith(BENIGN_CALLBACKS) for item in added)


class Verifier:
    """Built from the notebook as graded: [(index, role, source)] for its code cells; and the answer cells
    as released (their stubs: the names the learner is meant to define), default the answers in `cells`.
    Never the learner's own answers: a name they bind would escape the verification."""

    def __init__(self, cells: list[tuple[int, str, str]], released_answers: list[str] | None = None):
        released = [(i, role, python_source(src)) for i, role, src in cells if role in ("locked", "check")]
        if released_answers is None:
            released_answers = [src for _, role, src in cells if role == "answer"]
        answers = [python_source(src) for src in released_answers]
        answer_bound = set().union(*(set().union(*top_level_bindings(s)[:2]) for s in answers)) if answers else set()
        self.imported, self.assigned, self.bound_by = set(), set(), {}
        statements, chains = [], set()
        self.calls_learner = set()  # released cells that use a name the answers define: they run learner code
        for index, _, source in released:
            if {chain.split(".")[0] for chain in global_chains(source)} & answer_bound:
                self.calls_learner.add(index)
            imported, other, found = top_level_bindings(source)
            self.imported |= imported
            self.assigned |= other
            self.bound_by[index] = imported | other
            statements += found
            chains |= global_chains(source)
        self.import_only = self.imported - self.assigned
        bound = (self.imported | self.assigned) - answer_bound
        builtin_names = set(dir(builtins)) - self.imported - self.assigned - answer_bound
        self.chains = sorted(c for c in chains if c.split(".")[0] in bound | builtin_names)
        self.import_source = "\n".join(dict.fromkeys(statements))
        self.expected: dict[str, str] = {}
        self.pristine: dict[str, str] = {}

    def request(self, baseline: bool = False) -> tuple[str, dict, str]:
        nonce = secrets.token_hex(8)
        source = self.import_source if baseline else None
        code = f"{STATE_CODE}\n{RESULT_NAME} = _shardlib_grader_state({self.chains!r}, {source!r}, {nonce!r})\n" \
               "del _shardlib_grader_state"
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
        self.pristine = {key[len("pristine "):]: value for key, value in state.items() if key.startswith("pristine ")}
        self.expected = {key: value for key, value in state.items()
                         if not key.startswith(("pristine ", "name ", "nonce"))}
        for key, value in state.items():
            if key.startswith("name ") and value.startswith("builtin"):
                self.expected[key] = value  # builtins the released cells use: never shadowed

    def after(self, state: dict, index: int, role: str) -> list[str]:
        """What changed that may not have, after cell `index` (its role); the expectations moved on."""
        changed = []
        own = self.bound_by.get(index, set())
        if index in self.calls_learner:
            role = "check"  # a released cell that calls the learner's code may change no machinery either
        for key, value in state.items():
            if key == "nonce" or key.startswith("pristine "):
                continue
            chain = key[len("name "):] if key.startswith("name ") else None
            root = chain.split(".")[0] if chain else None
            if chain and root in self.import_only and value.startswith("user") and chain in self.pristine:
                if value != self.pristine[chain]:
                    changed.append(f"{chain} is not what `{self._import_of(root)}` gives")
                continue
            if chain and root in own:
                self.expected[key] = value  # this released cell (re)bound it
                continue
            if key not in self.expected:
                if chain is None and role == "locked":
                    self.expected[key] = value
                continue
            if value != self.expected[key]:
                if key.startswith("list event ") and only_benign_added(self.expected[key], value):
                    self.expected[key] = value  # `%matplotlib inline`, `%load_ext autoreload` in a learner's cell
                    continue
                if role == "locked" and chain is None:
                    self.expected[key] = value  # a released cell may change the machinery
                elif not (chain and value == "unbound"):  # a deleted name fails the check by itself
                    changed.append(f"{chain or key} was changed")
        return changed

    def _import_of(self, root: str) -> str:
        return next((line for line in self.import_source.splitlines() if root in line.replace(",", " ").split()),
                    f"import {root}")
