"""Reading the learner's cells for code that reaches around the checks: a list for a person to read.

Some ways to get a check to pass without doing the lab leave nothing for the kernel's verification to
see: they happen inside the ranks a check launches (each its own process), or they use what the checks
themselves hold (their reference data, the library's own version of the technique). The grader reads,
without running them, the cells the learner controls (answers, and cells they added) and lists what a
reader should look at, each with its cell and line:

    reaching in      frames, gc's object walks, ctypes, code objects, audit and import hooks, signals, threads,
                     the kernel (get_ipython, its sockets), sys.modules, builtins, pickling, dynamic names
    monkeypatching   an attribute of a module or class set or deleted (`torch.allclose = ...`, `setattr`),
                     a library's private names (`ledger._open`), a process group's own collectives
    lying objects    a class defining comparisons, truth or __torch_function__, or subclassing a tensor or number
    the checks' data a function or an answer using a name only the check cells define (`BATCHES`, `ref_state`);
                     a name the released cells define rebound from a function (`global TOL`) or changed in
                     place (`EXPECTED[2] = ...`, `.update(...)`): undone before the verification, the kernel's
                     verification would not see it
    ready answers    the library's own implementation of a technique, or a file named like the solutions

The list never changes the score: an honest cell can hit it, and code can be written to dodge a reading.
It says where to look; INSTRUCTORS.md ("Grading") says what is not seen at all.
"""

from __future__ import annotations

import ast
import symtable

from shardlib.course.grading.tamper import python_source, top_level_bindings

MODULES = {  # module: the attributes worth a look (None: any use of it)
    "ctypes": None, "_ctypes": None, "builtins": None, "importlib": None, "signal": None, "_thread": None,
    "threading": None, "atexit": None, "socket": None, "zmq": None, "jupyter_client": None, "ipykernel": None,
    "IPython": None, "pickle": None, "marshal": None, "copyreg": None, "subprocess": None, "multiprocessing": None,
    "faulthandler": None, "__main__": None, "gc": {"get_objects", "get_referrers", "get_referents", "callbacks"},
    "inspect": {"currentframe", "stack", "getouterframes", "getinnerframes", "trace", "getframeinfo"},
    "sys": {"_getframe", "_current_frames", "modules", "settrace", "setprofile", "addaudithook", "audit", "meta_path",
            "path_hooks", "path_importer_cache", "excepthook", "displayhook", "setswitchinterval"},
    "os": {"fork", "forkpty", "kill", "killpg", "_exit", "system", "setsid", "execv", "execve", "execvp", "popen",
           "environ", "putenv", "unsetenv", "posix_spawn", "spawnv", "write", "dup2"},
    "types": {"CodeType", "FunctionType", "FrameType"},
}
READY_MADE = ("shardlib.parallel", "shardlib.checks", "shardlib.course", "shardlib.lessons", "shardlib.solutions",
              "torch.distributed.fsdp", "torch.distributed._composable", "torch.distributed.optim",
              "torch.distributed.tensor.parallel", "torch.distributed.pipelining", "torch.nn.parallel")
ATTRIBUTES = {"__code__", "__globals__", "__closure__", "__builtins__", "__subclasses__", "__bases__", "__mro__",
              "__reduce__", "__reduce_ex__", "__setstate__", "f_back", "f_locals", "f_globals", "f_code", "tb_frame",
              "tb_next", "gi_frame", "cr_frame", "co_code", "user_ns", "user_global_ns", "shell_stream", "iopub_socket",
              "session", "__class__", "__dict__"}
PROCESS_GROUP_CALLS = {"allreduce", "allgather", "allgather_coalesced", "allreduce_coalesced", "reduce_scatter",
                       "_reduce_scatter_base", "_allgather_base", "alltoall", "alltoall_base", "distributed_c10d",
                       "_get_default_group", "_get_backend"}
CALLS = {"globals", "vars", "eval", "exec", "compile", "__import__", "get_ipython", "breakpoint"}
LYING = {"__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "__len__", "__float__", "__index__",
         "__torch_function__", "__torch_dispatch__", "__instancecheck__", "__subclasscheck__", "__getattribute__",
         "__getattr__", "__array_function__", "__array_ufunc__", "__hash__", "__abs__", "__sub__", "__rsub__"}
VALUE_TYPES = {"int", "float", "complex", "bool", "str", "bytes", "tuple", "list", "dict", "set", "frozenset",
               "Tensor", "Parameter", "ndarray"}


class Reader(ast.NodeVisitor):
    """Findings in one cell: (line, what)."""

    def __init__(self, modules: dict[str, str]):
        self.found: list[tuple[int, str]] = []
        self.modules = dict(modules)  # local name -> module it names (the released cells' imports, then the cell's)
        self.own: set[str] = set()  # the names this cell imports
        self.depth = 0  # inside a function or class body

    def note(self, node, what: str) -> None:
        self.found.append((getattr(node, "lineno", 0), what))

    def visit_Import(self, node):
        self.modules.update(imported_names(node))
        self.own |= set(imported_names(node))
        for alias in node.names:
            self._imported(node, alias.name)

    def visit_ImportFrom(self, node):
        self.modules.update(imported_names(node))
        self.own |= set(imported_names(node))
        for alias in node.names:
            self._imported(node, f"{node.module or ''}.{alias.name}")

    def _imported(self, node, full: str) -> None:
        top, _, rest = full.partition(".")
        if full.startswith(READY_MADE):
            self.note(node, f"imports {full}: the library's own implementation of a technique")
        elif top in MODULES and (MODULES[top] is None or rest.split(".")[0] in MODULES[top]):
            self.note(node, f"imports {full}")

    def visit_Attribute(self, node):
        root = node.value
        if isinstance(root, ast.Name) and root.id in self.modules:
            full = f"{self.modules[root.id]}.{node.attr}"
            top, _, rest = full.partition(".")
            if full.startswith(READY_MADE):
                if root.id in self.own:  # what a released cell imported is the lab's to give
                    self.note(node, f"uses {full}: the library's own implementation of a technique")
            elif top in MODULES and MODULES[top] is not None and rest.split(".")[0] in MODULES[top]:
                self.note(node, f"uses {full}")
            elif top in MODULES and MODULES[top] is None and self.modules[root.id] == top:
                self.note(node, f"uses {full}")
        if node.attr in PROCESS_GROUP_CALLS:
            self.note(node, f"calls .{node.attr}: a process group's own collective, which the ledger does not record")
        if node.attr.startswith("_") and not node.attr.startswith("__") and self._library_object(node.value):
            self.note(node, f"uses {ast.unparse(node)}: a library's private name")
        if node.attr in ATTRIBUTES and not (node.attr in ("__class__", "__dict__", "session")
                                            and isinstance(node.ctx, ast.Load)):
            self.note(node, f"{'reads' if isinstance(node.ctx, ast.Load) else 'sets'} .{node.attr}")
        if isinstance(node.ctx, (ast.Store, ast.Del)) and self._library_object(node.value):
            self.note(node, f"{'sets' if isinstance(node.ctx, ast.Store) else 'deletes'} {ast.unparse(node)}: "
                            "an attribute of a library's module or class")
        self.generic_visit(node)

    def _library_object(self, node) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id in self.modules

    def visit_Call(self, node):
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name in CALLS:
            self.note(node, f"calls {name}()")
        if name in ("getattr", "setattr", "delattr", "hasattr") and len(node.args) >= 2:
            if not isinstance(node.args[1], ast.Constant):
                self.note(node, f"calls {name}() with a computed name")
            elif name in ("setattr", "delattr") and self._library_object(node.args[0]):
                self.note(node, f"calls {name}() on a library's module or class")
        if name == "type" and len(node.args) == 3:
            self.note(node, "makes a class with type(name, bases, namespace)")
        if name == "open" and any(isinstance(a, ast.Constant) and "solution" in str(a.value).lower()
                                  for a in node.args):
            self.note(node, "opens a file named like the solutions")
        self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str) and ("solutions/" in node.value or "solutions\\" in node.value):
            self.note(node, f"names {node.value[:60]!r}, like the solutions")

    def visit_ClassDef(self, node):
        bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
        if bases & VALUE_TYPES:
            self.note(node, f"class {node.name} subclasses {', '.join(sorted(bases & VALUE_TYPES))}")
        defined = {item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
        defined |= {t.id for item in node.body if isinstance(item, ast.Assign) for t in item.targets
                    if isinstance(t, ast.Name)}
        if defined & LYING:
            self.note(node, f"class {node.name} defines {', '.join(sorted(defined & LYING))}: "
                            "what the checks compare could lie")
        self._body(node)

    def visit_FunctionDef(self, node):
        self._body(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self._body(node)

    def _body(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    def visit_Name(self, node):
        if node.id in ("__builtins__", "__main__") and isinstance(node.ctx, ast.Load):
            self.note(node, f"uses {node.id}")


def globals_used(source: str, top_level: bool) -> set[str]:
    """The global names a cell's functions and classes read (and, with top_level, its top level too)."""
    try:
        table = symtable.symtable(source, "<cell>", "exec")
    except SyntaxError:
        return set()
    found, tables = set(), list(table.get_children())
    if top_level:
        found |= {s.get_name() for s in table.get_symbols() if s.is_referenced() and not s.is_assigned()}
    while tables:
        current = tables.pop()
        tables.extend(current.get_children())
        found |= {s.get_name() for s in current.get_symbols() if s.is_global() and s.is_referenced()}
    return found


def first_line(tree, name: str) -> int:
    return min((node.lineno for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == name), default=0)


def imported_names(node) -> dict[str, str]:
    """{local name: the module or object it names} for one import statement."""
    if isinstance(node, ast.Import):
        return {(a.asname or a.name).split(".")[0]: a.name if a.asname else a.name.split(".")[0] for a in node.names}
    return {a.asname or a.name: f"{node.module or ''}.{a.name}" for a in node.names}


def check_only_names(cells) -> dict[str, str]:
    """{name: 'check-K'} for the names the check cells bind that no other released cell (nor an answer's
    stub) binds. cells: [(index, role, source, grade_id)] of the notebook as graded."""
    by_checks, others = {}, set()
    for _, role, source, grade_id in cells:
        imported, other, _ = top_level_bindings(python_source(source))
        if role == "check":
            for name in (imported | other) - set(by_checks):
                by_checks[name] = grade_id
        elif role in ("locked", "answer-stub"):
            others |= imported | other
    return {name: check for name, check in by_checks.items() if name not in others}


MUTATORS = {"update", "append", "extend", "insert", "pop", "popitem", "clear", "setdefault", "add", "remove",
            "discard", "sort", "reverse", "copy_", "fill_", "zero_", "add_", "sub_", "mul_", "div_", "set_",
            "resize_", "__setitem__", "__delitem__", "__setattr__"}


def released_names(cells, stubs=()) -> set[str]:
    """The names the released cells (locked and checks) bind, but for those the answers' stubs bind."""
    released, learners = set(), set()
    for _, role, source, _ in cells:
        if role in ("locked", "check"):
            released |= top_level_bindings(python_source(source))[1]
    for stub in stubs:
        learners |= set().union(*top_level_bindings(python_source(stub))[:2])
    return released - learners


def changes_to_released(text: str, released: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each `global NAME` of a released name, and each change made in place to one (a name
    local to the function it is in is the learner's own)."""
    try:
        tree, table = ast.parse(text), symtable.symtable(text, "<cell>", "exec")
    except SyntaxError:
        return []
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                name = getattr(child, "name", "lambda")
                inner = next((t for t in scope.get_children() if t.get_name() == name
                              and t.get_lineno() == child.lineno), scope)
            note(child, scope)
            visit(child, inner)

    def is_released(name: str, scope) -> bool:
        if name not in released:
            return False
        try:
            symbol = scope.lookup(name)
        except KeyError:
            return True
        return scope.get_type() == "module" or symbol.is_global() or not (symbol.is_local() or symbol.is_free())

    def note(node, scope):
        if isinstance(node, ast.Global):
            for name in sorted(set(node.names) & released):
                found.append((node.lineno, f"declares global {name}: rebinds a name the released cells define"))
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            root = node.value
            while isinstance(root, (ast.Subscript, ast.Attribute)):
                root = root.value
            if isinstance(root, ast.Name) and is_released(root.id, scope):
                found.append((node.lineno, f"changes {ast.unparse(node)[:60]}: the released cells' {root.id}, in place"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
              and isinstance(node.func.value, ast.Name) and is_released(node.func.value.id, scope)):
            found.append((node.lineno, f"calls {node.func.value.id}.{node.func.attr}(): the released cells' "
                                       f"{node.func.value.id}, in place"))

    visit(tree, table)
    return found


def review(cells, stubs=()) -> list[str]:
    """What a reader should look at in the learner's cells. cells: [(index, role, source, grade_id)];
    stubs: the answers as released (the names they bind are the learner's to define)."""
    check_only = check_only_names([*cells, *((-1, "answer-stub", stub, "") for stub in stubs)])
    modules = {}
    for _, role, source, _ in cells:
        if role in ("locked", "check"):
            try:
                tree = ast.parse(python_source(source))
            except SyntaxError:
                continue
            for node in tree.body:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    modules.update(imported_names(node))
    released, findings = released_names(cells, stubs), []
    for index, role, source, _ in cells:
        if role not in ("answer", "learner"):
            continue
        text = python_source(source)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        reader = Reader(modules)
        reader.visit(tree)
        for name in sorted(globals_used(text, top_level=role == "answer") & set(check_only)):
            reader.found.append((first_line(tree, name), f"uses {name}, which only {check_only[name]} defines: "
                                                          "the checks' own data"))
        reader.found += changes_to_released(text, released)
        for line, what in sorted(set(reader.found)):
            findings.append(f"cell {index} ({role}) line {line}: {what}")
    return findings
