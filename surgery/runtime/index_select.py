"""An int argument that only selects a block's slot in a shared cache: pass the slot, not the index.

Why. A streaming block is often called with the whole cache of its stack and its own index in it
(the SDPA example's camera trunk: ``blk(x, cache, global_idx=i)``, then ``cache[global_idx]``).
Dynamo specializes an int that indexes a Python list, and it traces the list it indexes into, so
every instance traces graphs of its own (guards ``global_idx == i`` and the emptiness of
``cache[i]``, and the tensors of every other slot are guarded too). On the H200 the trunk's 4
blocks traced 8 graphs where 2 hold the same code (a stream's first frame and the full window),
and each graph costs a dynamo trace, a split and lookups of its pieces. ``mark_dynamic`` takes a
tensor dim, so no mark can make that index dynamic: the index must not reach dynamo at all.

What it does. When a piecewise region's forward takes a list cache ``C`` (a ``dynamic`` source
without a dim) and an int parameter ``I``, and ``I`` *only selects*, the runtime calls the
compiled forward with ``C = [C[I]]`` and ``I = 0``: the same slot object, so every append, pop
or in-place update of it lands in the real cache, and every instance then shows dynamo one call
shape. ``I`` only selects when, in the forward's own source (``ast``):

- every use of ``C`` is the load ``C[I]`` (no ``len(C)``, no ``C[I - 1]``, no ``C[I] = ...``, no
  passing ``C`` on), and every use of ``I`` is that subscript's index;
- neither name is assigned, deleted, rebound (``import ... as``, ``except ... as``, a ``match``
  capture, ``global``/``nonlocal``), or shadowed by a nested function's own parameter of that
  name (which would read as a plain use and refuse the rewrite);
- the function calls none of ``locals``, ``vars``, ``eval``, ``exec``, ``globals`` (which
  could read the names another way).

Anything else (no source, a source that does not parse as this function, another use) leaves
the call as it is. At call time the rewrite also needs ``type(C)`` to be exactly ``list`` or
``tuple`` and ``I`` an in-range ``int`` (not a bool); otherwise the call goes on unchanged, and
an out-of-range index raises the model's own error from its own code. Eager calls (a new
structure, a fallback) keep the caller's arguments. The analysis reads only the model's code,
never the manifest, so a hostile manifest cannot turn it on for a forward it does not hold for.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# False: never rewrite (what benchmarks compare with).
SELECT_SLOTS = True
# Calls that could read a parameter without naming it.
_INTROSPECTION = frozenset({"locals", "vars", "eval", "exec", "globals"})
# What a path's record notes when its calls pass the slot, not the index.
SELECT_NOTE = ("the int {index!r} only selects {container}[{index}]: the compiled calls pass "
               "{container}=[{container}[{index}]], {index}=0, so every instance shares its graphs")


@dataclass(frozen=True)
class IndexSelect:
    """``container[index]`` is the only use of both parameters: calls pass the slot alone."""

    container: str
    index: str
    names: tuple[str, ...]  # the callable's positional parameter names (without self)

    def note(self) -> str:
        return SELECT_NOTE.format(container=self.container, index=self.index)

    def rewrite(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The call's arguments with the slot in place of the cache and 0 as the index, or None
        when this call does not qualify (then it goes on unchanged)."""
        got_c, cache = self._get(self.container, args, kwargs)
        got_i, idx = self._get(self.index, args, kwargs)
        if not (got_c and got_i) or type(idx) is not int or type(cache) not in (list, tuple):
            return None
        if not -len(cache) <= idx < len(cache):
            return None  # the model's own code raises its own IndexError
        one = [cache[idx]] if type(cache) is list else (cache[idx],)
        new_args, new_kwargs = list(args), dict(kwargs)
        for name, value in ((self.container, one), (self.index, 0)):
            pos = self.names.index(name) if name in self.names else None
            if pos is not None and pos < len(new_args):
                new_args[pos] = value
            else:
                new_kwargs[name] = value
        return tuple(new_args), new_kwargs

    def _get(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
        if name in kwargs:
            return True, kwargs[name]
        pos = self.names.index(name) if name in self.names else None
        if pos is not None and pos < len(args):
            return True, args[pos]
        return False, None


def _function_node(fn: Callable[..., Any]) -> ast.FunctionDef | None:
    """The parsed ``def`` of fn, or None when its source is not available or not fn's."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(src)
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef) or node.name != fn.__name__:
        return None
    a = node.args
    parsed = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    n = code.co_argcount + code.co_kwonlyargcount
    if parsed != list(code.co_varnames[:n]):  # the file changed since the code was loaded
        return None
    return node


def _only_selects(node: ast.FunctionDef, container: str, index: str) -> bool:
    parents: dict[ast.AST, ast.AST] = {}
    for parent in ast.walk(node):
        for child in ast.iter_child_nodes(parent):
            parents[child] = parent
    uses = 0
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and \
                sub.func.id in _INTROSPECTION:
            return False
        if isinstance(sub, ast.arg) and sub.arg in (container, index) and \
                parents.get(sub) is not node.args:
            return False  # a nested function or lambda's own parameter of that name
        if isinstance(sub, ast.Global | ast.Nonlocal) and \
                {container, index} & set(sub.names):
            return False
        if _binds(sub) & {container, index}:
            return False  # rebound by a statement that names it without an ast.Name
        if not isinstance(sub, ast.Name) or sub.id not in (container, index):
            continue
        if not isinstance(sub.ctx, ast.Load):
            return False  # assigned or deleted
        up = parents.get(sub)
        if not isinstance(up, ast.Subscript) or not isinstance(up.ctx, ast.Load):
            return False
        value, key = up.value, up.slice
        if not (isinstance(value, ast.Name) and value.id == container and
                isinstance(key, ast.Name) and key.id == index):
            return False
        uses += sub.id == container
    return uses > 0


def _binds(sub: ast.AST) -> set[str]:
    """Names a node binds other than through an ``ast.Name`` store: ``import m as n``,
    ``except E as n``, and ``match`` captures (``case n``, ``case [*n]``, ``case {**n}``)."""
    if isinstance(sub, ast.alias):
        return {sub.asname or sub.name.split(".")[0]}
    if isinstance(sub, ast.ExceptHandler | ast.MatchAs | ast.MatchStar):
        return {sub.name} if sub.name else set()
    if isinstance(sub, ast.MatchMapping):
        return {sub.rest} if sub.rest else set()
    return set()


def find_index_select(fn: Callable[..., Any], names: Sequence[str],
                      containers: Sequence[str | None]) -> IndexSelect | None:
    """The first (container, index) pair of fn's parameters where the index only selects (see
    the module docstring); ``names``: fn's positional parameter names as called (no self),
    ``containers``: the parameters that hold a list cache."""
    node = _function_node(inspect.unwrap(getattr(fn, "__func__", fn))) if SELECT_SLOTS else None
    if node is None:
        return None
    a = node.args
    params = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    for c in containers:
        if c not in params:
            continue
        for i in params:
            if i != c and _only_selects(node, c, i):
                return IndexSelect(c, i, tuple(names))
    return None
