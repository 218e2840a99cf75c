"""The grader's own code in the kernel: it fingerprints what the checks rely on, and (once) guards the kernel.

Never imported into a kernel: tamper.Verifier sends this file's text with every verification request,
and it runs in a namespace of its own, so a notebook cannot edit it in advance. `state(...)` returns a
{key: fingerprint} (JSON) that the grader compares outside the kernel (what the walk reaches, under
"walk", by module or class: {"module IPython.core.interactiveshell": {"_pseudo_sync_runner": hash}});
`install_guard` runs once, before the notebook's first cell. Nothing here calls an object of the notebook's: fingerprints read
types exactly (`type(x) is ...`) and never call a `__repr__`, `__eq__` or `__dir__` it may have defined.

    fingerprint   identity; for Python functions also their code, globals and defaults; for plain data
                  (containers, tensors) its content, tensors by dtype, shape, version counter and bytes
    walk          from the kernel's machinery and every name the checks use, what their code reaches
                  (module globals its code names, attributes of those modules, class attributes, closures),
                  breadth first, at most WALK_LIMIT objects
    hooks         trace and profile functions, signal handlers and timers, import hooks, audit hook alive,
                  threads that run the notebook's code, event callbacks, transformers, display formatters
    canaries      what the checks' primitives answer on known inputs (1.0 < 0.5, torch.equal of 0 and 1, ...)
    lying types   subclasses of numbers, strings, containers and tensors whose comparisons, truth or
                  __torch_function__ are the notebook's code: an object a check compares could lie
    guard         a PEP 578 audit hook (Python code cannot remove it; the ranks inherit it): it refuses every
                  later audit hook, gc's object walks (gc.get_objects, get_referrers, get_referents) except from
                  the released cells' own code, and code objects made under a released cell's file name
"""

import builtins
import collections
import functools
import hashlib
import inspect
import json
import marshal
import os
import signal
import sys
import threading
import types

WALK_LIMIT = 60_000
DATA_BYTES = 16 * 2 ** 20  # tensor bytes hashed per verification; beyond, a tensor is fingerprinted without its bytes
ALIVE_EVENT = "shardlib.grader.alive"


def library_roots():
    """Folders whose code is the library's: the Python installation, its site folders, and the folder of
    every top-level module or package loaded before the notebook's first cell (each ending in a separator);
    never a folder the kernel may write (its home, its temporary files, its working folder, /tmp: a module's
    folder there counts only where the sandbox made it read-only, as it does for a course cloned into /tmp)."""
    import site

    def folder(path):
        return os.path.realpath(path).rstrip(os.sep) + os.sep

    installation = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages()}  # wherever it lives
    roots = set(installation)
    for name, module in list(sys.modules.items()):
        path = vars(module).get("__file__") if type(module) is type(sys) else None
        if "." not in name and type(path) is str and path:
            roots.add(os.path.dirname(path))
    writable = tuple(folder(p) for p in (os.environ.get("HOME", ""), os.environ.get("TMPDIR", ""), os.getcwd(), "/tmp")
                     if p)
    installation = {folder(root) for root in installation if root}
    found = {folder(root) for root in roots if root} | {root.rstrip(os.sep) + os.sep for root in roots if root}
    found = {root for root in found if root != os.sep and not any(w.startswith(root) for w in writable)
             and (root in installation or not root.startswith(writable) or not os.access(root, os.W_OK))}
    return sorted(root for root in found if not any(root != other and root.startswith(other) for other in found))


def install_guard(released_files, roots):
    """The audit hook (see the module docstring). `released_files`: the file names of the released cells."""
    import _thread

    getframe, get_ident, startswith = sys._getframe, _thread.get_ident, str.startswith
    released, roots = frozenset(released_files), tuple(roots) + ("<frozen ",)
    kernel_threads = frozenset(thread.ident for thread in threading.enumerate())
    walks = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})
    makes_code = frozenset({"compile", "code.__new__"})

    def is_library(filename):
        return type(filename) is str and startswith(filename, roots)

    def from_notebook():  # the nearest code that is not the library's decides; none: the kernel's own threads are
        frame = getframe(2)
        while frame is not None:
            filename = frame.f_code.co_filename
            if not is_library(filename):
                return True
            frame = frame.f_back
        return get_ident() not in kernel_threads

    def guard(event, args):
        if event == ALIVE_EVENT:
            args[0].append(1)
        elif event == "sys.addaudithook":
            raise RuntimeError("the grader refuses audit hooks from the notebook")  # silently: the hook is not added
        elif event in walks:  # only the released cells' own code walks the objects (a memory probe)
            if getframe(1).f_code.co_filename not in released:
                raise RuntimeError(f"{event} is not allowed while the notebook is graded, except in the released cells")
        elif event in makes_code:  # a released cell's file name: only the kernel's own compilation of that cell
            filename = args[1]
            if type(filename) is str and filename in released and from_notebook():
                raise RuntimeError(f"code under a released cell's file name ({filename}) is not the notebook's to make")

    sys.addaudithook(guard)


def canaries(torch):
    """What the checks' primitives answer on known inputs: any change (a C slot poked, a builtin type's
    method swapped through gc, a Tensor method replaced) shows here, however it was made."""
    import math

    tests = [lambda: 1.0 < 0.5, lambda: 0.5 > 1.0, lambda: 2 == 3, lambda: 1e-12 > 1e-9, lambda: abs(-2.0),
             lambda: all([False]), lambda: any([False]), lambda: sum([1, 2]), lambda: len([1, 2]), lambda: sorted([2, 1]),
             lambda: max(1, 2), lambda: min(1, 2), lambda: math.isclose(1.0, 2.0), lambda: math.ceil(1.5),
             lambda: isinstance(1, str), lambda: "a" == "b", lambda: [1] == [2], lambda: {"a": 1} == {"a": 2},
             lambda: (1, 2) < (1, 1)]
    if torch is not None:
        one, zero = torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        tests += [lambda: torch.equal(zero, one), lambda: torch.allclose(zero, one), lambda: bool((zero == one).any()),
                  lambda: float((one - zero).abs().max()), lambda: one.sum().item(),
                  lambda: bool(torch.isclose(zero, one).all()), lambda: torch.testing.assert_close(zero, one)]
    answers = []
    for test in tests:
        try:
            answers.append(safe(test()))
        except Exception as error:  # noqa: BLE001 - the answer is what it raised
            answers.append(f"raised {type_name(type(error))}")
    return str(answers)


SCALARS = (int, float, complex, str, bytes, bool, type(None), range, slice)
PLAIN_DATA = (*SCALARS, tuple, list, dict, set, frozenset, collections.OrderedDict, collections.defaultdict,
              collections.deque)
CODE_LIKE = (types.FunctionType, types.MethodType, staticmethod, classmethod, property, functools.partial)
NOT_WALKED = (BaseException, types.TracebackType, types.FrameType)
# exact types looked up by identity (id), never by == or hash: a class's metaclass could answer those
SCALAR_IDS, PLAIN_DATA_IDS = frozenset(map(id, SCALARS)), frozenset(map(id, PLAIN_DATA))
SEQUENCE_IDS = frozenset(map(id, (tuple, list, frozenset)))
TYPE_DICT, TYPE_MRO = type.__dict__["__dict__"].__get__, type.__dict__["__mro__"].__get__
TYPE_MODULE, TYPE_QUALNAME = type.__dict__["__module__"].__get__, type.__dict__["__qualname__"].__get__
BUILTIN_NAMES = frozenset(vars(builtins))
WATCHED_PACKAGES = ("builtins", "sys", "json", "hashlib", "marshal", "inspect", "types", "math", "operator",
                    "functools", "IPython", "ipykernel", "jupyter_client", "zmq", "torch", "numpy", "shardlib", "gc",
                    "warnings", "collections", "signal", "threading", "pickle", "multiprocessing")


def type_name(cls):
    try:
        return f"{TYPE_MODULE(cls)}.{TYPE_QUALNAME(cls)}"
    except (TypeError, AttributeError):
        return "?"


def safe(value, depth=0):
    """A repr of plain values only: no __repr__ of the notebook's runs here."""
    t = type(value)
    if id(t) in SCALAR_IDS:
        return repr(value)[:200]
    if id(t) in SEQUENCE_IDS and depth < 2:
        return t.__name__ + "(" + ", ".join(safe(v, depth + 1) for v in list(value)[:20]) + ")"
    return f"<{type_name(t)} {id(value)}>"


def digest(code):
    """A Python function's code, nested functions included: marshal's bytes of it (version 2, which writes no
    back-references, so the same code always gives the same bytes), else (a constant marshal cannot write,
    put there with code.replace) read by hand."""
    try:
        return hashlib.sha256(marshal.dumps(code, 2)).hexdigest()[:16]
    except ValueError:
        return digest_by_hand(code)


def digest_by_hand(code):
    """The same, read attribute by attribute (constants through safe(): no repr of the notebook's runs)."""
    h, stack = hashlib.sha256(), [code]
    while stack:
        c = stack.pop()
        h.update(c.co_code + repr((c.co_names, c.co_varnames, c.co_freevars, c.co_flags)).encode())
        for k in c.co_consts:
            stack.append(k) if type(k) is types.CodeType else h.update(safe(k).encode())
    return h.hexdigest()[:16]


def text(value):
    """safe() of a name, without its quotes."""
    return repr(value)[:200][1:-1] if type(value) is str else safe(value)[1:-1]


def code_names(code):
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if type(k) is types.CodeType)
    return names


class Fingerprints:
    """out: {key: fingerprint}; the walk adds its bindings to one digest per module or class."""

    def __init__(self, nonce, torch, roots):
        self.out, self.torch, self.roots = {"nonce": nonce}, torch, tuple(roots) + ("<frozen ",)
        self.memo, self.origins = {}, {}  # by id, with the object kept: its id stays its own during this call
        self.tensor_types = (torch.Tensor, torch.nn.Parameter) if torch is not None else ()
        self.groups, self.seen, self.queue, self.walked = collections.defaultdict(dict), set(), collections.deque(), 0
        self.data_budget, self.shadows, self.bases = DATA_BYTES, {}, {}
        self.lines = {}  # by id: what a binding to that object records (bind), with the object kept

    def fp(self, obj):
        key = id(obj)
        known = self.memo.get(key)
        if known is None:
            known = self.memo[key] = (self._fp(obj), obj)  # obj kept: its id stays its own during this call
        return known[0]

    def _fp(self, obj):
        t = type(obj)
        if t is types.FunctionType:
            module_globals, code = obj.__globals__, obj.__code__
            defaults, keywords = obj.__defaults__, obj.__kwdefaults__
            return (f"function {text(dict.get(module_globals, '__name__', '?'))}.{text(obj.__qualname__)} "
                    f"in {text(code.co_filename)} {id(obj)} code {digest(code)} globals {id(module_globals)} "
                    f"defaults {'None' if defaults is None else safe(defaults)} "
                    f"{'tuple()' if keywords is None else safe(tuple(keywords.items()))}")
        if t is types.MethodType:
            return f"method of {id(obj.__self__)}: {self.fp(obj.__func__)}"
        if t in (staticmethod, classmethod):
            return f"{t.__name__}: {self.fp(obj.__func__)}"
        if t is property:
            return f"property {self.fp(obj.fget)} {self.fp(obj.fset)} {self.fp(obj.fdel)}"
        if t is functools.partial:
            return f"partial {id(obj)} of {self.fp(obj.func)} {safe(obj.args)}"
        if id(t) in SCALAR_IDS or t is tuple or t is frozenset:
            return f"{t.__name__} {id(obj)} {hashlib.sha256(safe(obj).encode()).hexdigest()[:16]}"
        return f"{type_name(t)} {id(obj)}"

    def content(self, obj, depth=0):
        """Plain data by value (tensors by dtype, shape, version, place and bytes); anything else by identity."""
        t = type(obj)
        if t in SCALARS:
            return safe(obj)
        if depth > 6:
            return f"<deep {type_name(t)} {id(obj)}>"
        if t in (list, tuple):
            return f"{t.__name__}{len(obj)}[" + ",".join(self.content(v, depth + 1) for v in list(obj)[:2000]) + "]"
        if t in (dict, collections.OrderedDict, collections.defaultdict):
            return f"dict{len(obj)}{{" + ",".join(f"{self.content(k, depth + 1)}:{self.content(v, depth + 1)}"
                                                   for k, v in list(dict.items(obj))[:2000]) + "}"
        if t in (set, frozenset):
            return f"{t.__name__}{len(obj)}{{" + ",".join(sorted(self.content(v, depth + 1) for v in obj)) + "}"
        if t in self.tensor_types:
            return self.tensor(obj)
        return f"<{type_name(t)} {id(obj)}>"

    def tensor(self, t):
        torch = self.torch
        text = (f"tensor {t.dtype} {tuple(t.shape)} {t.stride()} v{t._version} "
                f"at {t.data_ptr() if t.layout == torch.strided else '-'} {t.device}")
        nbytes = t.numel() * t.element_size()
        if t.device.type == "cpu" and t.layout == torch.strided and nbytes <= self.data_budget:
            self.data_budget -= nbytes
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            text += " " + hashlib.sha256(raw).hexdigest()[:16]
        return text

    def record(self, key, value):
        """A fingerprint of its own, and what it reaches walked."""
        self.out[key] = self.fp(value)
        self.reach(value, "reached from " + key.split(" ")[0])

    def bind(self, group, key, value):
        """A binding the walk found (a module's global, a class's attribute, a closure's cell), by digest."""
        line = self.line_of(value)
        if line is not None:
            self.groups[group][key] = line

    def line_of(self, value):
        """line(value), worked out once per object; what it reaches queued for the walk."""
        key = id(value)
        known = self.lines.get(key)
        if known is None:
            known = self.lines[key] = (self.line(value), value)  # value kept: its id stays its own
            if known[0] is not None:
                self.reach(value, "")
        return known[0]

    def line(self, value):
        """What a binding to `value` records, or None for data the walk leaves alone."""
        if id(type(value)) in PLAIN_DATA_IDS or isinstance(value, NOT_WALKED) or (
                isinstance(value, type) and issubclass(value, BaseException)):
            return None  # a library's own data (caches, registries, flags, sys.last_type) changes as it runs
        wrapped = self.wrapped(value)
        return f"{self.entry(value)}|{self.origin(value)}|{self.entry(wrapped) if wrapped is not None else ''}"

    def entry(self, value):
        """A short digest (str hashes are stable within one kernel process: all compared entries come from it)."""
        if isinstance(value, CODE_LIKE) or isinstance(value, type) or type(value) is types.ModuleType:
            text = self.fp(value)
        else:  # an instance: the library may rebind it (sys.last_value); a fake of another class shows
            text = f"instance of {self.fp(type(value))}"
        return format(hash(text) & 0xFFFFFFFFFFFF, "x")

    @staticmethod
    def wrapped(value):
        """What a decorator (functools.wraps, lru_cache) says `value` wraps, else None."""
        t = type(value)
        if t is types.FunctionType:
            return value.__dict__.get("__wrapped__")
        if t is functools._lru_cache_wrapper:
            return value.__wrapped__
        return None

    def decorated(self, value):
        """What `value` decorates, where it is a library's wrapper closing over it (torch._dynamo, imported lazily
        by torch.optim or torch.profiler, rebinds torch.manual_seed to such a wrapper), else None."""
        wrapped = self.wrapped(value) if type(value) is types.FunctionType else None
        if wrapped is None or not self.origin(value):
            return None
        for cell in value.__closure__ or ():
            try:
                if cell.cell_contents is wrapped:
                    return wrapped
            except ValueError:
                continue
        return None

    def library(self, filename):
        return type(filename) is str and filename.startswith(self.roots)

    def origin(self, value):
        """The library module that defines `value` (its code is the library's files), else ''."""
        key = id(value)
        known = self.origins.get(key)
        if known is None:
            known = self.origins[key] = (self._origin(value), value)
        return known[0]

    def _origin(self, value):
        t = type(value)
        if t is types.FunctionType:
            name = dict.get(value.__globals__, "__name__", "")
            return name if type(name) is str and self.library(value.__code__.co_filename) else ""
        if t is types.MethodType or t is staticmethod or t is classmethod:
            return self.origin(value.__func__)
        if t is property:
            return self.origin(value.fget) if value.fget is not None else ""
        if t is functools.partial:
            return self.origin(value.func)
        if t is functools._lru_cache_wrapper:
            return self.origin(value.__wrapped__)
        if t is types.ModuleType:
            return vars(value).get("__name__", "") if self.library(vars(value).get("__file__")) else ""
        cls = value if isinstance(value, type) else t
        name = TYPE_MODULE(cls)
        module = sys.modules.get(name) if type(name) is str else None
        if module is None or not self.library(vars(module).get("__file__")):
            return ""
        own_code = [v for v in list(TYPE_DICT(cls).values()) if type(v) is types.FunctionType]
        return name if all(self.library(v.__code__.co_filename) for v in own_code) else ""

    def reach(self, value, group):
        if not isinstance(value, CODE_LIKE) and not isinstance(value, type):
            value = type(value)  # an instance: what it does is its class
        key = id(value)
        if key not in self.seen and self.walked < WALK_LIMIT:
            self.seen.add(key)
            self.walked += 1
            self.queue.append(value)

    def walk(self):
        while self.queue:
            self.explore(self.queue.popleft())
        self.out.update(walk=self.groups, shadows=self.shadows, bases=self.bases)
        self.out["walked"] = str(self.walked) if self.walked < WALK_LIMIT else "limit"

    def explore(self, obj):
        t = type(obj)
        if t is types.FunctionType:
            self.explore_function(obj)
        elif t in (types.MethodType, staticmethod, classmethod):
            self.reach(obj.__func__, "")
        elif t is property:
            for part in (obj.fget, obj.fset, obj.fdel):
                if part is not None:
                    self.reach(part, "")
        elif t is functools.partial:
            self.reach(obj.func, "")
        elif isinstance(obj, type):
            group = "class " + type_name(obj)
            bucket, line_of = None, self.line_of
            for name, value in list(TYPE_DICT(obj).items()):
                line = line_of(value)
                if line is not None:
                    bucket = self.groups[group] if bucket is None else bucket  # made once it has a binding
                    bucket[name] = line
            bases = TYPE_MRO(obj)[1:]
            self.bases[group] = ["class " + type_name(base) for base in bases]
            for i, base in enumerate(bases):
                self.bind(group, f"<base {i}>", base)

    def explore_function(self, function):
        module_globals = function.__globals__
        if type(module_globals) is not dict:
            return
        where = dict.get(module_globals, "__name__", "?")
        where = where if type(where) is str else safe(where)
        if where not in self.shadows:  # a module's own globals named like builtins: one added later shadows one
            self.shadows[where] = sorted(name for name, value in module_globals.items() if type(name) is str
                                         and name in BUILTIN_NAMES and type(value) is not types.ModuleType)
        names, group, line_of = code_names(function.__code__), self.groups["module " + where], self.line_of
        for name in names:
            if name in module_globals:
                value = module_globals[name]
                line = line_of(value)
                if line is not None:
                    group[name] = line
                if type(value) is types.ModuleType:
                    attributes, bucket = vars(value), None
                    for attribute in names:
                        if attribute in attributes:
                            line = line_of(attributes[attribute])
                            if line is not None:
                                if bucket is None:
                                    bucket = self.groups[f"module {text(attributes.get('__name__', '?'))}"]
                                bucket[attribute] = line
        for i, cell in enumerate(function.__closure__ or ()):
            try:
                # keyed by the function too: closures of one name (a decorator's wrapper around many functions)
                self.bind("module " + where, f"{text(function.__qualname__)}.<cell {i}> of {id(function)}",
                          cell.cell_contents)
            except ValueError:
                pass


def machinery(shell):
    """The objects that run a cell and send its reply, by label."""
    kernel = getattr(shell, "kernel", None)
    owners = {"shell": shell, "kernel": kernel, "compiler": getattr(shell, "compile", None),
              "displayhook": getattr(shell, "displayhook", None), "events": getattr(shell, "events", None),
              "display formatter": getattr(shell, "display_formatter", None),
              "transformer manager": getattr(shell, "input_transformer_manager", None),
              "prefilter": getattr(shell, "prefilter_manager", None), "history": getattr(shell, "history_manager", None)}
    for name in ("session", "shell_stream", "iopub_socket", "iopub_thread", "control_stream"):
        owners[name] = getattr(kernel, name, None)
    for mime, formatter in dict(getattr(owners["display formatter"], "formatters", None) or {}).items():
        owners[f"formatter {mime}"] = formatter
    return {label: owner for label, owner in owners.items() if owner is not None}


def fingerprint_machinery(f, shell):
    for label, owner in machinery(shell).items():
        f.bind(label, "class", type(owner))
        for name in object.__dir__(owner):  # what a lookup on the object finds: its own attribute, else its class's
            if name in ("_", "__", "___"):
                continue  # the displayhook's last outputs
            try:
                value = inspect.getattr_static(owner, name)
            except AttributeError:
                continue
            if callable(value) or type(value) in (staticmethod, classmethod, property):
                f.bind(label, name, value)
        for table in ("type_printers", "deferred_printers", "singleton_printers"):
            printers = getattr(owner, table, None) if label.startswith("formatter ") else None
            if printers is not None:
                f.out[f"printers {label} {table}"] = str(sorted(
                    f"{type_name(key) if isinstance(key, type) else safe(key)}: {f.fp(value)}|{f.origin(value)}"
                    for key, value in dict(printers).items()))
    manager, prefilter = shell.input_transformer_manager, getattr(shell, "prefilter_manager", None)
    lists = {"input_transformers_cleanup": shell.input_transformers_cleanup, "ast_transformers": shell.ast_transformers,
             "input_transformers_post": shell.input_transformers_post,
             "cleanup_transforms": getattr(manager, "cleanup_transforms", []),
             "line_transforms": getattr(manager, "line_transforms", []),
             "token_transformers": getattr(manager, "token_transformers", []),
             "prefilter transformers": getattr(prefilter, "transformers", []),
             "prefilter checkers": getattr(prefilter, "checkers", []),
             "sys.meta_path": sys.meta_path, "sys.path_hooks": sys.path_hooks}
    lists.update(("event " + name, callbacks) for name, callbacks in shell.events.callbacks.items())
    for label, items in lists.items():
        f.out["list " + label] = f"{id(items)} {[f'{f.fp(item)}|{f.origin(item)}' for item in list(items)]}"
        for item in list(items):
            f.reach(item, "")
    kernel = getattr(shell, "kernel", None)
    for name in ("shell_handlers", "control_handlers"):
        for kind, handler in dict(getattr(kernel, name, None) or {}).items():
            f.record(f"kernel.{name}[{kind}]", handler)


def fingerprint_hooks(f, shell):
    hooks = {"sys.excepthook": sys.excepthook, "sys.displayhook": sys.displayhook, "sys.gettrace()": sys.gettrace(),
             "sys.getprofile()": sys.getprofile(), "sys.breakpointhook": sys.breakpointhook,
             "sys.unraisablehook": sys.unraisablehook, "threading.excepthook": threading.excepthook,
             "threading trace": getattr(threading, "_trace_hook", None),
             "threading profile": getattr(threading, "_profile_hook", None),
             "shell.custom_exceptions": shell.custom_exceptions, "shell.CustomTB": getattr(shell, "CustomTB", None),
             "shell.user_ns": shell.user_ns, "shell.user_global_ns": shell.user_global_ns,
             "sys.modules": sys.modules, "builtins": sys.modules.get("builtins")}
    for number in sorted(signal.valid_signals()):
        try:
            hooks[f"signal {int(number)}"] = signal.getsignal(number)
        except (OSError, ValueError):
            pass
    for label, value in hooks.items():
        f.record(label, value)
    for timer in ("ITIMER_REAL", "ITIMER_VIRTUAL", "ITIMER_PROF"):
        f.out[f"timer {timer}"] = "armed" if any(signal.getitimer(getattr(signal, timer))) else "off"
    for name in sorted(sys.modules):  # the modules the machinery and the checks import, by identity
        if name.split(".")[0] in WATCHED_PACKAGES:
            f.out[f"module {name}"] = f.fp(sys.modules[name])
    f.out["env"] = str(sorted((k, v) for k, v in os.environ.items() if k.startswith(("SHARDLIB_", "IPYKERNEL_"))))
    alive = []
    sys.audit(ALIVE_EVENT, alive)
    f.out["audit guard"] = "alive" if alive == [1] else f"answered {safe(alive)}"
    for name, value in list(vars(builtins).items()):
        if name not in ("_", "__", "___"):
            f.bind("builtins", name, value)
    classes = [int, float, bool, str, bytes, list, tuple, dict, set, frozenset, object, type, BaseException,
               Exception, AssertionError, types.FunctionType, types.CodeType, types.ModuleType]
    if f.torch is not None:
        classes += [f.torch.Tensor, f.torch._C.TensorBase, f.torch.nn.Module, f.torch.nn.Parameter]
    for cls in classes:
        for name in dir(cls):
            try:
                f.bind(f"builtin class {type_name(cls)}", name, inspect.getattr_static(cls, name))
            except AttributeError:
                pass
    for tool in (json.dumps, json.JSONEncoder, hashlib.sha256, marshal.dumps, inspect.getattr_static, sys.audit, dir,
                 getattr, callable, isinstance, vars, id, type, repr):
        f.bind("probe tools", getattr(tool, "__qualname__", "?"), tool)


def resolve(f, namespace, chain):
    """'user|builtin <fingerprint>' of a dotted name, and the object; modules read through their dict."""
    parts = chain.split(".")
    if parts[0] in namespace:
        obj, where = namespace[parts[0]], "user"
    elif parts[0] in vars(builtins):
        obj, where = vars(builtins)[parts[0]], "builtin"
    else:
        return "unbound", None
    for attribute in parts[1:]:
        if type(obj) is types.ModuleType:
            attributes = vars(obj)
            if attribute not in attributes:
                return where + " absent", None
            obj = attributes[attribute]
        elif isinstance(obj, type):
            try:
                obj = inspect.getattr_static(obj, attribute)
            except AttributeError:
                return where + " absent", None
        else:
            return where + " instance", None
    return where + " " + f.fp(obj), obj


def threads_running_notebook_code(roots):
    """Threads (other than this one) with a frame, or a target, that is not the library's code."""
    frames, roots = sys._current_frames(), tuple(roots) + ("<frozen ",)
    known, found = {thread.ident for thread in threading.enumerate()}, []
    for ident, frame in frames.items():
        if ident == threading.get_ident():
            continue  # this one runs the grader
        thread, files = threading._active.get(ident), []
        while frame is not None:
            files.append(frame.f_code.co_filename)
            frame = frame.f_back
        target = getattr(thread, "_target", None) or getattr(thread, "function", None)
        if type(target) is types.FunctionType:
            files.append(target.__code__.co_filename)
        if any(not (type(name) is str and name.startswith(roots)) for name in files):
            found.append(thread.name if ident in known else f"a thread started without threading ({ident})")
    return str(sorted(found))


LYING = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "__len__", "__float__", "__int__",
         "__index__", "__abs__", "__sub__", "__rsub__", "__hash__", "__torch_function__", "__torch_dispatch__",
         "__getattribute__", "__getattr__", "__instancecheck__", "__array_ufunc__", "__array_function__", "item",
         "tolist", "equal", "allclose")


def lying_types(torch, roots, released):
    """Subclasses of a number, a string, a container or a tensor whose own code, not the library's nor a released
    cell's, answers comparisons, truth or torch's functions: what a check compares could lie."""
    bases = [int, float, complex, str, bytes, tuple, list, dict, set, frozenset]
    if torch is not None:
        bases.append(torch.Tensor)
    roots, found, seen, stack = tuple(roots) + ("<frozen ",), [], set(), list(bases)
    while stack:
        for sub in type.__subclasses__(stack.pop()):
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            stack.append(sub)
            own = TYPE_DICT(sub)
            for name in LYING:
                value = own.get(name)
                value = value.__func__ if type(value) in (staticmethod, classmethod) else value
                if type(value) is types.FunctionType:
                    filename = value.__code__.co_filename
                    if not (type(filename) is str and (filename.startswith(roots) or filename in released)
                            or made_by_dataclasses(sub, value, roots)):
                        found.append(f"{type_name(sub)}.{name}")
    return str(sorted(found))


def made_by_dataclasses(cls, function, roots) -> bool:
    """A library dataclass's own comparison: compiled by dataclasses from text (file name '<string>') with the
    globals of the module defining the class, a module of the library's, and the very code dataclasses makes
    for those fields (the same bytecode, names and constants)."""
    name = dict.get(function.__globals__, "__name__")
    module = sys.modules.get(name) if type(name) is str else None
    filename = dict.get(module.__dict__, "__file__") if type(module) is types.ModuleType else None
    code, fields = function.__code__, TYPE_DICT(cls).get("__dataclass_fields__")
    if not (code.co_filename == "<string>" and type(fields) is dict and type(filename) is str
            and function.__globals__ is module.__dict__ and str.startswith(filename, roots)):
        return False
    made = _dataclass_comparisons(tuple(n for n in code.co_names if type(n) is str and n.isidentifier()))
    twin = made.get(code.co_name)
    return twin is not None and (code.co_code, code.co_consts, code.co_names) == (
        twin.co_code, twin.co_consts, twin.co_names)


@functools.lru_cache(maxsize=None)
def _dataclass_comparisons(names: tuple) -> dict:
    """The comparisons dataclasses compiles for fields `names` (those between '__class__' and 'NotImplemented')."""
    import dataclasses

    fields = names[1:-1] if names[:1] == ("__class__",) and names[-1:] == ("NotImplemented",) else ()
    if not fields or len(set(fields)) != len(fields) or any(n.startswith("__") for n in fields):
        return {}
    twin = dataclasses.make_dataclass("Twin", list(fields), eq=True, order=True)
    return {name: vars(twin)[name].__code__ for name in ("__eq__", "__lt__", "__le__", "__gt__", "__ge__")}


def collector_switch(name):
    """gc's own `name` (isenabled, disable, enable): a builtin of the gc module, else None (a stand-in is never
    called)."""
    gc = sys.modules.get("gc")
    switch = vars(gc).get(name) if type(gc) is types.ModuleType else None
    real = type(switch) is types.BuiltinFunctionType and switch.__self__ is gc and switch.__name__ == name
    return switch if real else None


def state(*request):
    """The fingerprints (_state), with the cyclic garbage collector paused meanwhile where it ran: the walk
    makes tens of thousands of small containers, and each of the collections that sets off goes over the
    whole kernel's heap (torch's objects and the notebook's)."""
    isenabled, disable, enable = map(collector_switch, ("isenabled", "disable", "enable"))
    paused = None not in (isenabled, disable, enable) and isenabled()
    if paused:
        disable()
    try:
        return _state(*request)
    finally:
        if paused:
            enable()


def _state(chains, data_roots, nonce, roots, baseline_imports=None, released_sources=(), released_files=()):
    """The fingerprints, as JSON. At the baseline (baseline_imports is not None): first import what the
    released cells import (privately), install the guard, and return the released cells' file names and
    the library's folders (`roots`, given back with every later request)."""
    shell = get_ipython()  # noqa: F821 - the kernel's builtin
    private, extra = None, {}
    if baseline_imports is not None:
        private = {}
        exec(baseline_imports, private)
        extra["released files"] = [shell.compile.get_code_name(source, source, 0) for source in released_sources]
        extra["library roots"] = roots = library_roots()
        released_files = extra["released files"]
        install_guard(released_files, roots)
    torch = sys.modules.get("torch")
    f = Fingerprints(nonce, torch, roots)
    f.out.update(extra, canaries=canaries(torch))  # first: what they import lazily is imported before the walk
    fingerprint_machinery(f, shell)
    fingerprint_hooks(f, shell)
    for chain in chains:
        f.out["name " + chain], obj = resolve(f, shell.user_ns, chain)
        if obj is not None:
            f.reach(obj, "")
            wrapped = f.decorated(obj)
            if wrapped is not None:
                f.out["wraps " + chain] = f.fp(wrapped)
    for chain in chains if private is not None else ():
        if chain.split(".")[0] in private:
            f.out["pristine " + chain] = resolve(f, private, chain)[0]
    for root in data_roots:
        if root in shell.user_ns:
            f.out["data " + root] = hashlib.sha256(f.content(shell.user_ns[root]).encode()).hexdigest()[:24]
    f.walk()
    f.out["threads running notebook code"] = threads_running_notebook_code(roots)
    f.out["lying types"] = lying_types(torch, roots, frozenset(released_files))
    f.out["library modules"] = sorted(name for name, module in list(sys.modules.items())
                                      if type(name) is str and f.library(getattr(module, "__file__", None)))
    return json.dumps(f.out)
