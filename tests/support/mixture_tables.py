"""TOML tables of a data mixture for tests: [[data.sources]] and [[data.stages]] entries, and the two-source
synthetic mixture with one late stage that the loader, skip and long-run tests share."""

import json


def source(name: str, kind: str, weight, **extra) -> str:
    lines = [f'name = "{name}"', f'source = "{kind}"', f"weight = {weight}"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in extra.items()]
    return "\n[[data.sources]]\n" + "\n".join(lines) + "\n"


def stage(name: str, start_step: int, weights: str) -> str:
    return f'\n[[data.stages]]\nname = "{name}"\nstart_step = {start_step}\nweights = {{ {weights} }}\n'


def two_sources(late_step: int) -> str:
    """Synthetic sources a (weight 2) and b (weight 1), then from `late_step` a stage that favours b 3:1."""
    return (
        source("a", "synthetic", 2, seed=1)
        + source("b", "synthetic", 1, seed=2)
        + stage("late", late_step, "a = 1, b = 3")
    )
