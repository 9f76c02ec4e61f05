"""What rlpipe's code uses from the TPU stack's packages, read from its source (rlpipe itself is not imported).

A use is a dotted name rooted at an import of torch_tpu, vllm, vllm_torchtpu or jax (at any depth of the file), at
`torch.tpu`, at the names `jax_modules()` binds (rlpipe's lazy jax import), or at a variable or `self.<name>` that
was assigned a call of one of those classes (`self.llm = LLM(...)` makes `self.llm.generate` the use
`vllm.LLM.generate`). Inside a class that vLLM mixes into its worker (`extensions`), `self.<name>` is the worker's
unless the class defines the name, and `collective_rpc("<method>")` names a method of that worker. A call through a
use also records its positional count and keyword names. `check` resolves each use in the installed packages
(following instance attributes through the types their classes assign or annotate) and binds each call against the
real object's signature.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("torch_tpu", "vllm", "vllm_torchtpu", "jax")
# rlpipe/kernels/_jax.py: `jax, jnp, pl = jax_modules()`.
LAZY_MODULES = {"jax_modules": ("jax", "jax.numpy", "jax.experimental.pallas")}


@dataclass
class Use:
    name: str  # dotted, e.g. jax.experimental.pallas.pallas_call or vllm.LLM.generate
    where: str  # file:line of the first use
    on_instance: bool = False  # reached through an instance of the class the name starts with
    calls: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)  # (positional count, keywords)


def _ours(dotted: str) -> bool:
    return dotted.split(".")[0] in PACKAGES or dotted.startswith("torch.tpu")


class _Scope:
    """A file's names for our packages: module/object aliases, and expressions holding instances of our classes."""

    def __init__(self, tree: ast.AST):
        self.aliases: dict[str, str] = {}
        self.instances: dict[str, str] = {}  # "self.llm" -> "vllm.LLM"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _ours(alias.name):
                        self.aliases[alias.asname or alias.name.split(".")[0]] = (
                            alias.name if alias.asname else alias.name.split(".")[0]
                        )
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _ours(node.module):
                for alias in node.names:
                    self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                  and isinstance(node.value.func, ast.Name) and node.value.func.id in LAZY_MODULES
                  and isinstance(node.targets[0], ast.Tuple)):
                for target, module in zip(node.targets[0].elts, LAZY_MODULES[node.value.func.id]):
                    if isinstance(target, ast.Name):
                        self.aliases[target.id] = module
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Call):
                cls, _ = self.dotted(node.value.func)
                if cls and isinstance(node.targets[0], (ast.Name, ast.Attribute)) and cls.split(".")[-1][:1].isupper():
                    self.instances[ast.unparse(node.targets[0])] = cls

    def dotted(self, node: ast.AST) -> tuple[str | None, bool]:
        """(dotted name, whether it is reached through an instance) of an expression, or (None, False)."""
        parts = []
        while True:
            key = ast.unparse(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
            if parts and key in self.instances:
                return ".".join([self.instances[key], *reversed(parts)]), True
            if not isinstance(node, ast.Attribute):
                break
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None, False
        if node.id in self.aliases:
            return ".".join([self.aliases[node.id], *reversed(parts)]), False
        if node.id == "torch" and parts and parts[-1] == "tpu":
            return ".".join(["torch", *reversed(parts)]), False
        return None, False


def collect(root: Path, extensions: dict[str, str], folders=("rlpipe", "actors")) -> dict[str, Use]:
    """`extensions`: rlpipe class name -> dotted name of the worker class vLLM mixes it into."""
    uses: dict[str, Use] = {}
    worker = next(iter(extensions.values()), None)
    paths = sorted(p for folder in folders for p in (root / folder).rglob("*.py"))
    # The extension's own methods, wherever it is defined: `collective_rpc` names them from other modules too.
    own_methods = {
        item.name
        for path in paths
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ClassDef) and node.name in extensions
        for item in node.body
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    for path in paths:
        source = path.read_text()
        if not any(package in source for package in (*PACKAGES, "torch.tpu")):
            continue
        tree = ast.parse(source, str(path))
        scope = _Scope(tree)
        where = path.relative_to(root)
        inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}  # a.b of a.b.c

        def add(name: str, line: int, on_instance: bool = False) -> Use:
            return uses.setdefault(name, Use(name, f"{where}:{line}", on_instance))

        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in extensions:
                own = {item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
                for inner_node in ast.walk(node):
                    if (isinstance(inner_node, ast.Attribute) and id(inner_node) not in inner
                            and isinstance(inner_node.ctx, ast.Load)):
                        chain = ast.unparse(inner_node).split(".")
                        if chain[0] == "self" and chain[1] not in own and all(part.isidentifier() for part in chain):
                            add(".".join([extensions[node.name], *chain[1:]]), inner_node.lineno, True)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "collective_rpc" and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and worker and node.args[0].value not in own_methods):
                add(f"{worker}.{node.args[0].value}", node.lineno, True)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _ours(node.module):
                for alias in node.names:
                    add(f"{node.module}.{alias.name}", node.lineno)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if _ours(alias.name):
                        add(alias.name, node.lineno)
            elif isinstance(node, ast.Attribute) and id(node) not in inner:
                name, on_instance = scope.dotted(node)
                if name:
                    add(name, node.lineno, on_instance)
            if isinstance(node, ast.Call):
                name, on_instance = scope.dotted(node.func)
                if name:
                    positional = sum(not isinstance(arg, ast.Starred) for arg in node.args)
                    keywords = tuple(k.arg for k in node.keywords if k.arg is not None)  # not **mapping
                    add(name, node.lineno, on_instance).calls.append((positional, keywords))
    return uses


class InstanceAttribute:
    """An attribute a class's methods assign (`self.x = ...`): it exists, of a type the source does not say."""


def _instance_attribute(cls: type, attribute: str):
    """The type a class's methods give `self.<attribute>` (annotated, or the class called), InstanceAttribute when
    they assign it without saying, None when they never do."""
    found = None
    for klass in inspect.getmro(cls):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        namespace = vars(sys.modules[klass.__module__])
        for node in ast.walk(tree):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or not any(
                isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                and t.attr == attribute for t in targets
            ):
                continue
            found = found or InstanceAttribute()
            said = node.annotation if isinstance(node, ast.AnnAssign) else (
                node.value.func if isinstance(node.value, ast.Call) else None)
            try:
                kind = eval(ast.unparse(said), namespace) if said is not None else None  # names of that module
            except Exception:  # noqa: BLE001  (a forward reference or an expression: the type stays unknown)
                kind = None
            if isinstance(kind, type):
                return kind
    return found


def resolve(dotted: str):
    """The installed object a dotted name means: the longest importable module prefix, then attributes (through
    the types of instance attributes where the classes say them; an instance attribute of unknown type ends it)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if isinstance(obj, type) and not hasattr(obj, attribute):
                kind = _instance_attribute(obj, attribute)
                if isinstance(kind, InstanceAttribute):
                    return kind
                if kind is not None:
                    obj = kind
                    continue
            if not isinstance(obj, (type, types.ModuleType)):
                inspect.getattr_static(obj, attribute)  # an object's __getattr__ may answer any name (vLLM's platform)
            obj = getattr(obj, attribute)  # AttributeError: the package has no such name
        return obj
    raise ImportError(f"no module of {dotted} imports")


def _engine_arg_names() -> set[str]:
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def check(use: Use) -> str | None:
    """None when the use holds against the installed packages, else why not."""
    try:
        obj = resolve(use.name)
    except (ImportError, AttributeError) as err:
        return f"{type(err).__name__}: {err}"
    if not use.calls or not callable(obj) or isinstance(obj, InstanceAttribute):
        return None
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: existence is what can be checked
    owner, _, attribute = use.name.rpartition(".")
    bound_self = use.on_instance and inspect.isfunction(obj) and not isinstance(
        inspect.getattr_static(resolve(owner), attribute), staticmethod
    )
    for positional, keywords in use.calls:
        try:
            signature.bind_partial(*([None] * (positional + bound_self)), **dict.fromkeys(keywords))
        except TypeError as err:
            return f"call with {positional} positional and keywords {list(keywords)}: {err}"
        if use.name == "vllm.LLM":  # LLM(**kwargs) hands what it does not name to EngineArgs
            unknown = set(keywords) - set(signature.parameters) - _engine_arg_names()
            if unknown:
                return f"LLM(...) keywords that neither LLM nor EngineArgs take: {sorted(unknown)}"
    return None
