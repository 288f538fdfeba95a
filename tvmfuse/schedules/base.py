"""The contract every schedule template follows, and the pass that applies templates to a module.

A template (one fused-kernel family, one target family) declares its knob space first, as data, then
applies a configuration on an ``s_tir.Schedule``:

    class MatmulEpilogue(Template):
        family = "matmul_epilogue"
        def match(self, func, target) -> Match | None      # None: the template does not apply
        config_type = MatmulConfig                          # typed knobs: a frozen Config dataclass
        def space(self, match, target) -> KnobSpace         # the knobs' legal choices, per target
        def default_config(self, match, target) -> dict     # untuned default from the target's numbers
        def apply(self, sch, match, config) -> None         # the body, in "# Step N." comments

The tuner (tvmfuse.tune) searches ``space``; the pipeline applies a tuned record if one exists for the
workload (structural hash of the PrimFunc + target), else ``default_config``; the chosen knobs are
recorded as data (``tvmfuse.explain.record_schedule``).
"""
from __future__ import annotations

import itertools
import logging
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

from .. import _compat as C

log = logging.getLogger("tvmfuse.schedule")


@dataclass(frozen=True)
class Knob:
    """One tunable decision: a name, its legal choices (JSON values), and what it controls."""

    name: str
    choices: tuple
    doc: str = ""

    def __post_init__(self):
        if not self.choices:
            raise ValueError(f"knob {self.name!r} has no choices")


@dataclass(frozen=True)
class Exclusion:
    """A rule that takes some combinations of a space's knobs out of it: ``check`` gets the values of
    ``knobs`` (by name) and returns why that combination is not in the space, or None when it is."""

    knobs: tuple[str, ...]
    check: Callable[..., str | None]


# Draws of a uniform sample before giving up on a space whose exclusions leave too few configs to hit.
SAMPLE_DRAWS = 1000


@dataclass(frozen=True)
class KnobSpace:
    """An ordered set of knobs; a config is a dict knob name -> one of its choices.  The space is the
    product of the knobs' choices less the combinations an ``Exclusion`` takes out."""

    knobs: tuple[Knob, ...]
    exclusions: tuple[Exclusion, ...] = ()

    def __post_init__(self):
        names = set(self.names)
        for ex in self.exclusions:
            if not set(ex.knobs) <= names:
                raise ValueError(f"exclusion {ex.check.__name__} reads knobs {sorted(set(ex.knobs) - names)} "
                                 f"the space does not have")

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.knobs]

    def excluded(self, config: dict) -> str | None:
        """Why ``config`` (one choice per knob) is excluded from the space, or None."""
        for ex in self.exclusions:
            why = ex.check(**{n: config[n] for n in ex.knobs})
            if why is not None:
                return why
        return None

    def size(self) -> int:
        """The number of configs: the product of the choices of the knobs no exclusion reads, times the
        legal combinations of those that one reads."""
        read = {n for ex in self.exclusions for n in ex.knobs}
        n = 1
        for k in self.knobs:
            if k.name not in read:
                n *= len(k.choices)
        if read:
            sub = [k for k in self.knobs if k.name in read]
            n *= sum(1 for vals in itertools.product(*[k.choices for k in sub])
                     if self.excluded(dict(zip([k.name for k in sub], vals))) is None)
        return n

    def contains(self, config: dict) -> bool:
        return set(config) == set(self.names) and all(config[k.name] in k.choices for k in self.knobs) \
            and self.excluded(config) is None

    def sample(self, rng: random.Random) -> dict:
        """A config drawn uniformly from the space (rejecting excluded draws)."""
        for _ in range(SAMPLE_DRAWS):
            config = {k.name: rng.choice(k.choices) for k in self.knobs}
            if self.excluded(config) is None:
                return config
        raise ValueError(f"knob space {self.to_dict()}: no config outside its exclusions in {SAMPLE_DRAWS} "
                         f"draws (last refused: {self.excluded(config)})")

    def all_configs(self, limit: int | None = None):
        prod = itertools.product(*[k.choices for k in self.knobs])
        i = 0
        for vals in prod:
            if limit is not None and i >= limit:
                return
            config = dict(zip(self.names, vals))
            if self.excluded(config) is None:
                i += 1
                yield config

    def neighbors(self, config: dict) -> list[dict]:
        """Configs of the space that differ from ``config`` in one knob by one step of its choice list."""
        out = []
        for k in self.knobs:
            i = k.choices.index(config[k.name])
            for j in (i - 1, i + 1):
                if 0 <= j < len(k.choices):
                    other = {**config, k.name: k.choices[j]}
                    if self.excluded(other) is None:
                        out.append(other)
        return out

    def to_dict(self) -> dict:
        return {k.name: list(k.choices) for k in self.knobs}


_NO_PRE_KNOB = object()      # ``knob(before=...)`` not given: the knob has no value from before it existed


def knob(doc: str, candidates: tuple = (), before=_NO_PRE_KNOB):
    """A field of a typed config: one knob, with what it controls (the knob's doc) and, optionally, the
    family's candidate values (``Config.space`` takes them when it is given no choices for the knob) and
    ``before``: the value that gives the kernel the template built before the knob was added (a tuning
    record written then lacks the knob and was measured with that behaviour, ``Config.pre_knob_values``)."""
    meta = {"doc": doc, "candidates": tuple(candidates)}
    if before is not _NO_PRE_KNOB:
        meta["before"] = before
    return field(metadata=meta)


class Config:
    """Base of a template family's typed config: subclass it as a ``@dataclass(frozen=True)`` whose fields
    (``knob("doc")``) are the knobs, in the order the space lists them.  Records keep configs as JSON
    dicts: ``asdict`` writes one, ``from_dict`` reads one back (a dict naming other knobs is an error)."""

    @classmethod
    def knob_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def space(cls, exclusions: tuple[Exclusion, ...] = (), **choices) -> KnobSpace:
        """The knob space: one knob per field, in field order, with the given legal choices (a knob given
        none: the candidates its field declares), less the combinations ``exclusions`` take out."""
        names = cls.knob_names()
        choices = {**{f.name: f.metadata["candidates"] for f in fields(cls) if f.metadata.get("candidates")},
                   **choices}
        missing, extra = [n for n in names if n not in choices], sorted(set(choices) - set(names))
        if missing or extra:
            raise ValueError(f"{cls.__name__} space: choices missing for {missing}, not knobs: {extra}")
        return KnobSpace(tuple(Knob(f.name, tuple(choices[f.name]), f.metadata.get("doc", ""))
                               for f in fields(cls)), tuple(exclusions))

    @classmethod
    def pre_knob_values(cls) -> dict:
        """The knobs declared with ``knob(before=...)``: their values for a record that predates them."""
        return {f.name: f.metadata["before"] for f in fields(cls) if "before" in f.metadata}

    @classmethod
    def from_dict(cls, config: dict):
        names = cls.knob_names()
        if set(config) != set(names):
            raise ValueError(f"{cls.__name__}: config {sorted(config)} does not name the knobs {names}")
        return cls(**config)

    def asdict(self) -> dict:
        return asdict(self)


@dataclass
class Match:
    """What a template found in a PrimFunc (block names, loop extents...): the template's own data."""

    family: str
    info: dict = field(default_factory=dict)


class Template:
    """Base class of schedule templates; see the module docstring."""

    family: str = ""
    target_kinds: tuple[str, ...] = ()
    config_type: type | None = None      # the family's typed Config (None: plain dict knobs)

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        raise NotImplementedError

    def accepts(self, group, target: C.Target) -> str | None:
        """Asked by the fusion rules before the group's kernel exists (``analysis.GroupInfo``: the ops'
        kinds, shapes, row keys, data operands, anchor PrimFuncs): None when ``match`` will take the fused
        kernel, else why not.  A family that does not override it is not asked; on CPU the generic schedule
        answers last for the kernels such families take (``schedules.accepting_template``)."""
        raise NotImplementedError

    def wants_unit_nest(self, match: Match, target: C.Target, func: C.PrimFunc, scheduled: C.PrimFunc) -> bool:
        """Whether the kernel ``func`` (over symbolic extents; ``scheduled``: as this template scheduled it)
        also gets a nest with every shape variable 1 (``schedules.buckets.unit_nest``), run at that size;
        none by default."""
        return False

    def buckets(self, match: Match, target: C.Target) -> tuple:
        """Size buckets (``schedules.buckets.Bucket``) of a template that dispatches at run time on a
        symbolic extent; then it also defines ``bucket_match(match, bucket)``, ``dispatch_extent(match)``
        and ``bucket_sizes(match, bucket, target)`` (shape variable -> size the tuner measures it at).
        Empty (the default): one nest for every size."""
        return ()

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        raise NotImplementedError

    def default_config(self, match: Match, target: C.Target) -> dict:
        raise NotImplementedError

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        raise NotImplementedError


@dataclass
class Scheduled:
    func: C.PrimFunc
    template: str
    config: dict
    source: str          # "tuned", "default", "fallback"
    reason: str = ""


def schedule_with(template: Template, match: Match, func: C.PrimFunc, config: dict) -> C.PrimFunc:
    """Apply ``template`` with ``config`` to a copy of ``func``; errors propagate (callers decide).  Index
    divisions by a symbolic extent that cannot wrap are dropped (``index_bounds``: the static build's
    simplifier removes them)."""
    from .index_bounds import drop_wrapless_modulo

    rewrite = getattr(template, "rewrite", None)
    if rewrite is not None:
        # a family whose kernels have no blocks to schedule (cpu.scan: TVM's extern scan) rewrites the loops
        return drop_wrapless_modulo(rewrite(func, match, config))
    # before the template inlines producers too: a block's index over its own bounded iterators simplifies
    # there, and not once a gather's index value replaces the iterator (deberta_v2_dyn's c2p / p2c gathers)
    sch = C.Schedule(drop_wrapless_modulo(func))
    template.apply(sch, match, config)
    return drop_wrapless_modulo(sch.mod["main"])


def find_template(func: C.PrimFunc, target: C.Target, templates) -> tuple[Template, Match] | None:
    for t in templates:
        if target.kind.name not in t.target_kinds:
            continue
        m = t.match(func, target)
        if m is not None:
            return t, m
    return None
