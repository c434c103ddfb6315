"""Prompt modules (Prompt Cache, Gim et al., MLSys 2024): a schema of reusable modules with reserved positions.

Markup (a small XML dialect, as in the paper)::

    <schema name="support">
      <module name="system">You are a helpful assistant.</module>
      <module name="manual" start="32" scope="prefix">The manual of <param name="product" len="8"/>: ...</module>
    </schema>

    <prompt schema="support"><system/><manual product="Falcon X"/>How do I reset it?</prompt>

A module occupies a reserved position range ``[start, start + length)``: ``start`` defaults to the end of the
previous module, ``length`` to its tokens plus its parameter slots. A parameter slot reserves ``len`` positions;
its value is prefilled at query time at the slot's first positions. ``scope="prefix"`` encodes the module after
every module declared before it (use it when those always come first: then the prompt's KV equals full prefill);
the default ``scope="independent"`` encodes it alone at its positions (the paper's choice: any subset reusable).

Free text in a prompt takes the positions after the previous item's range. Everything here is tokenizer-agnostic:
``compile``/``assemble`` take a ``tokenize(text) -> ids`` callable.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvshelf.reuse.errors import (
    ContextTooLongError,
    MissingParameterError,
    ParameterTooLongError,
    PromptLayoutError,
    SchemaError,
    UnknownModuleError,
    UnknownParameterError,
)

Tokenize = Callable[[str], list[int]]
SCOPES = ("independent", "prefix")


@dataclass(frozen=True)
class Param:
    """A parameter slot of ``max_len`` positions."""

    name: str
    max_len: int


@dataclass(frozen=True)
class Module:
    """A module: text pieces and parameter slots, an optional fixed ``start`` and reserved ``length``."""

    name: str
    parts: tuple[str | Param, ...]
    start: int | None = None
    length: int | None = None
    scope: str = "independent"


@dataclass(frozen=True)
class ModuleUse:
    """A module chosen in a prompt, with its parameter values."""

    name: str
    params: Mapping[str, str] = field(default_factory=dict)


PromptItem = ModuleUse | str


@dataclass(frozen=True)
class CompiledModule:
    """A module laid out: its cached tokens with their positions, its slots and its reserved range."""

    name: str
    start: int
    end: int  # reserved range is [start, end)
    tokens: tuple[int, ...]  # the module's own text tokens (cached KV)
    positions: tuple[int, ...]  # the position of each token
    slots: tuple[tuple[str, int, int], ...]  # (param name, first position, max_len)
    scope: tuple[str, ...]  # modules it was encoded after (empty: independent)


@dataclass(frozen=True)
class CompiledSchema:
    name: str
    modules: tuple[CompiledModule, ...]

    def module(self, name: str) -> CompiledModule:
        for m in self.modules:
            if m.name == name:
                return m
        raise UnknownModuleError(
            f"schema {self.name!r} has no module {name!r}; it declares {[m.name for m in self.modules]}"
        )


@dataclass(frozen=True)
class Assembly:
    """An assembled prompt in position order: per row its token, position and whether its KV is cached
    (and by which module); ``modules`` are the modules used, in order."""

    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    cached_by: tuple[str | None, ...]
    modules: tuple[CompiledModule, ...]

    @property
    def uncached(self) -> int:
        return sum(1 for c in self.cached_by if c is None)


def _int_attr(element: ET.Element, name: str, what: str) -> int | None:
    raw = element.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise SchemaError(f"{what}: attribute {name}={raw!r} is not an integer") from None
    if value < 0:
        raise SchemaError(f"{what}: attribute {name}={value} must be >= 0")
    return value


@dataclass(frozen=True)
class PromptSchema:
    """A schema: its modules in declared order. Build it in Python or with ``from_markup``."""

    name: str
    modules: tuple[Module, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for m in self.modules:
            if not m.name:
                raise SchemaError(f"schema {self.name!r}: a module has no name")
            if m.name in seen:
                raise SchemaError(f"schema {self.name!r}: module {m.name!r} is declared twice")
            seen.add(m.name)
            if m.scope not in SCOPES:
                raise SchemaError(f"module {m.name!r}: scope must be one of {SCOPES}, got {m.scope!r}")
            params = [p.name for p in m.parts if isinstance(p, Param)]
            if len(params) != len(set(params)):
                raise SchemaError(f"module {m.name!r}: a parameter is declared twice ({params})")
            for p in m.parts:
                if isinstance(p, Param) and p.max_len <= 0:
                    raise SchemaError(f"module {m.name!r}: parameter {p.name!r} needs len > 0, got {p.max_len}")

    @classmethod
    def from_markup(cls, markup: str) -> PromptSchema:
        try:
            root = ET.fromstring(markup)
        except ET.ParseError as exc:
            raise SchemaError(f"schema markup is not well-formed: {exc}") from None
        if root.tag != "schema":
            raise SchemaError(f"schema markup must have a <schema> root, got <{root.tag}>")
        name = root.get("name") or "schema"
        if (root.text or "").strip():
            raise SchemaError(f"schema {name!r}: text outside a module: {(root.text or '').strip()[:40]!r}")
        modules = []
        for element in root:
            if element.tag != "module":
                raise SchemaError(f"schema {name!r}: unexpected <{element.tag}> (only <module> may appear)")
            if (element.tail or "").strip():
                raise SchemaError(f"schema {name!r}: text outside a module: {(element.tail or '').strip()[:40]!r}")
            mname = element.get("name") or ""
            what = f"module {mname!r}"
            parts: list[str | Param] = [element.text] if element.text else []
            for child in element:
                if child.tag != "param":
                    raise SchemaError(f"{what}: unexpected <{child.tag}> (only <param> may appear)")
                max_len = _int_attr(child, "len", f"{what} parameter") or _int_attr(child, "max-len", what)
                if not child.get("name") or max_len is None:
                    raise SchemaError(f"{what}: <param> needs name and len attributes")
                parts.append(Param(child.get("name", ""), max_len))
                if child.tail:
                    parts.append(child.tail)
            modules.append(Module(mname, tuple(parts), _int_attr(element, "start", what),
                                  _int_attr(element, "length", what), element.get("scope", "independent")))
        return cls(name, tuple(modules))

    def compile(self, tokenize: Tokenize, max_positions: int | None = None) -> CompiledSchema:
        """Tokenize every text piece and lay the modules out; checks ranges (no overlap, within the model)."""
        compiled: list[CompiledModule] = []
        cursor = 0
        for m in self.modules:
            start = cursor if m.start is None else m.start
            pos = start
            tokens: list[int] = []
            positions: list[int] = []
            slots: list[tuple[str, int, int]] = []
            for part in m.parts:
                if isinstance(part, Param):
                    slots.append((part.name, pos, part.max_len))
                    pos += part.max_len
                else:
                    ids = list(tokenize(part))
                    tokens.extend(ids)
                    positions.extend(range(pos, pos + len(ids)))
                    pos += len(ids)
            needed = pos - start
            if m.length is not None and m.length < needed:
                raise SchemaError(f"module {m.name!r} needs {needed} positions but reserves length={m.length}")
            end = start + (m.length if m.length is not None else needed)
            if not tokens:
                raise SchemaError(f"module {m.name!r} has no text to cache")
            scope = tuple(c.name for c in compiled) if m.scope == "prefix" else ()
            compiled.append(CompiledModule(m.name, start, end, tuple(tokens), tuple(positions), tuple(slots), scope))
            cursor = end
        ordered = sorted(compiled, key=lambda c: c.start)
        for a, b in zip(ordered, ordered[1:], strict=False):
            if b.start < a.end:
                raise SchemaError(
                    f"schema {self.name!r}: module {b.name!r} [{b.start}, {b.end}) overlaps module {a.name!r} "
                    f"[{a.start}, {a.end})"
                )
        for c in compiled:
            if c.scope and any(compiled[i].start > c.start for i in range(len(c.scope))):
                raise SchemaError(f"module {c.name!r} has scope='prefix' but an earlier module lies after it")
            if max_positions is not None and c.end > max_positions:
                raise ContextTooLongError(
                    f"module {c.name!r} reserves positions up to {c.end}, over the model's {max_positions}"
                )
        return CompiledSchema(self.name, tuple(compiled))


def parse_prompt(markup: str) -> tuple[str | None, list[PromptItem]]:
    """``<prompt schema="name"><module param="value"/>free text</prompt>`` -> ``(schema name, items)``."""
    try:
        root = ET.fromstring(markup)
    except ET.ParseError as exc:
        raise SchemaError(f"prompt markup is not well-formed: {exc}") from None
    if root.tag != "prompt":
        raise SchemaError(f"prompt markup must have a <prompt> root, got <{root.tag}>")
    items: list[PromptItem] = []
    if root.text and root.text.strip():
        items.append(root.text)
    for element in root:
        if len(element):
            raise SchemaError(f"<{element.tag}> in a prompt cannot contain elements")
        items.append(ModuleUse(element.tag, dict(element.attrib)))
        if element.tail and element.tail.strip():
            items.append(element.tail)
    return root.get("schema"), items


def assemble(
    schema: CompiledSchema,
    items: Sequence[PromptItem],
    tokenize: Tokenize,
    *,
    max_positions: int | None = None,
    max_new_tokens: int = 0,
) -> Assembly:
    """Lay a prompt out: modules at their schema positions, parameter values in their slots, free text after the
    previous item. Raises the reuse errors for unknown modules/parameters, long values, bad order, overflow."""
    rows: list[tuple[int, int, str | None]] = []  # (position, token, cached_by)
    used: list[CompiledModule] = []
    cursor = 0
    for item in items:
        if isinstance(item, str):
            ids = list(tokenize(item))
            rows.extend((cursor + i, t, None) for i, t in enumerate(ids))
            cursor += len(ids)
            continue
        module = schema.module(item.name)
        if module in used:
            raise PromptLayoutError(f"module {module.name!r} is used twice in one prompt")
        if module.start < cursor:
            raise PromptLayoutError(
                f"module {module.name!r} reserves positions from {module.start} but the prompt already reaches "
                f"position {cursor} (modules out of schema order, or free text too long before it)"
            )
        missing_scope = [name for name in module.scope if name not in {u.name for u in used}]
        if missing_scope:
            raise PromptLayoutError(
                f"module {module.name!r} was encoded after {list(module.scope)} (scope='prefix'); the prompt "
                f"must use {missing_scope} before it"
            )
        slot_names = [s[0] for s in module.slots]
        for name in item.params:
            if name not in slot_names:
                raise UnknownParameterError(
                    f"module {module.name!r} has no parameter {name!r}; it declares {slot_names}"
                )
        for name, first, max_len in module.slots:
            if name not in item.params:
                raise MissingParameterError(f"module {module.name!r}: parameter {name!r} needs a value")
            ids = list(tokenize(item.params[name]))
            if len(ids) > max_len:
                raise ParameterTooLongError(
                    f"module {module.name!r}: parameter {name!r} is {len(ids)} tokens, its slot holds {max_len}"
                )
            rows.extend((first + i, t, None) for i, t in enumerate(ids))
        rows.extend((p, t, module.name) for p, t in zip(module.positions, module.tokens, strict=True))
        used.append(module)
        cursor = module.end
    if not rows:
        raise PromptLayoutError("the prompt is empty")
    rows.sort(key=lambda r: r[0])
    last = rows[-1][0] + 1
    if max_positions is not None and last + max_new_tokens > max_positions:
        raise ContextTooLongError(
            f"the assembled prompt reaches position {last} and {max_new_tokens} new tokens need "
            f"{last + max_new_tokens} positions, over the model's {max_positions}"
        )
    return Assembly(tuple(r[1] for r in rows), tuple(r[0] for r in rows), tuple(r[2] for r in rows), tuple(used))
