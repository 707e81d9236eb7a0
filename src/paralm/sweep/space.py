"""The search space from the command line: `--grid FIELD=V1,V2,...` and `--sample FIELD=DIST:ARGS`.

Values stay strings here; `paralm.sweep.plan` gives them the config field's type. Sampling uses Ray
Tune's own distributions with one seeded generator, so a sweep's trials are drawn once, recorded, and
the same on `--resume`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from paralm.errors import UserError

DISTRIBUTIONS = ("uniform", "loguniform", "randint", "choice")


@dataclass(frozen=True)
class GridAxis:
    field: str
    values: tuple[str, ...]
    spec: str  # as the user wrote it, for error messages


@dataclass(frozen=True)
class SampledAxis:
    field: str
    distribution: str
    args: tuple[str, ...]  # bounds, or the choices
    spec: str

    def domain(self) -> Any:
        """The Ray Tune distribution this axis draws from."""
        from ray import tune

        if self.distribution == "choice":
            return tune.choice(list(self.args))
        low, high = self.bounds()
        return getattr(tune, self.distribution)(low, high)

    def bounds(self) -> tuple[float, float] | tuple[int, int]:
        kind = int if self.distribution == "randint" else float
        return kind(self.args[0]), kind(self.args[1])

    def extremes(self) -> list[Any]:
        """Values of the type the distribution yields, to type-check the field before drawing."""
        if self.distribution == "choice":
            return list(self.args)
        low, high = self.bounds()
        return [low, high - 1] if self.distribution == "randint" else [low, high]  # randint excludes high


def _field_and_value(spec: str, flag: str, form: str) -> tuple[str, str]:
    field, has_value, value = spec.partition("=")
    section, _, name = field.partition(".")
    if not has_value or not value or not section or not name:
        raise UserError(f"{flag} {spec}: expected {form}")
    return field, value


def parse_grid(spec: str) -> GridAxis:
    field, value = _field_and_value(spec, "--grid", "FIELD=V1,V2,... e.g. --grid train.lr=1e-3,3e-3")
    values = tuple(v.strip() for v in value.split(","))
    if any(not v for v in values):
        raise UserError(f"--grid {spec}: an empty value in the list; write FIELD=V1,V2,...")
    return GridAxis(field, values, spec)


def parse_sample(spec: str) -> SampledAxis:
    form = "FIELD=uniform:A:B | loguniform:A:B | randint:A:B | choice:V1,V2,..."
    field, value = _field_and_value(spec, "--sample", form)
    distribution, _, rest = value.partition(":")
    if distribution not in DISTRIBUTIONS:
        raise UserError(f"--sample {spec}: unknown distribution {distribution!r}; expected {form}")
    if distribution == "choice":
        args = tuple(v.strip() for v in rest.split(","))
        if any(not v for v in args):
            raise UserError(f"--sample {spec}: choice needs values, e.g. choice:64,128")
        return SampledAxis(field, distribution, args, spec)
    args = tuple(rest.split(":"))
    axis = SampledAxis(field, distribution, args, spec)
    try:
        if len(args) != 2:
            raise ValueError
        low, high = axis.bounds()
    except ValueError:
        kind = "integers" if distribution == "randint" else "numbers"
        raise UserError(f"--sample {spec}: {distribution} needs two {kind}, {distribution}:A:B") from None
    if not low < high:
        raise UserError(f"--sample {spec}: the lower bound must be below the upper one")
    if distribution == "loguniform" and low <= 0:
        raise UserError(f"--sample {spec}: loguniform needs positive bounds")
    return axis


def check_distinct(fields: list[str], fixed: set[str]) -> None:
    """A field is searched along one axis, and is not also fixed by a `--section.field=value` override."""
    for field in fields:
        if fields.count(field) > 1:
            raise UserError(f"{field} is searched twice: give it one --grid or --sample")
        if field in fixed:
            raise UserError(f"{field} is both searched and set with --{field}=...: drop one of them")


def expand(grid: list[GridAxis], sampled: list[SampledAxis], repeats: int, seed: int) -> list[dict[str, Any]]:
    """Every trial's searched values: the grid's cartesian product, `repeats` times, each time with
    fresh draws for the sampled fields (Ray Tune's `num_samples` semantics)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    domains = [(axis.field, axis.domain()) for axis in sampled]
    combos = list(itertools.product(*(axis.values for axis in grid)))
    trials = []
    for _ in range(repeats):
        for combo in combos:
            values: dict[str, Any] = {axis.field: value for axis, value in zip(grid, combo, strict=True)}
            for field, domain in domains:
                values[field] = _plain(domain.sample(random_state=rng))
            trials.append(values)
    return trials


def _plain(value: Any) -> Any:
    """numpy scalars to Python numbers, so they coerce, print and serialise like the user's own."""
    return value.item() if hasattr(value, "item") else value
