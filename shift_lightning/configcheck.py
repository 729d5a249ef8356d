"""What a config file may hold, checked before the parser sees it (framework-free).

* every section (``model:``, ``data:``, ``trainer:``, …) is a mapping of options (or the name of a
  file holding one), never a list or a number;
* YAML aliases may not expand into more than :data:`MAX_VALUES` values (an "alias bomb" of a few
  lines would otherwise take all memory and time while the parser copies it).
"""

from __future__ import annotations

from .errors import UsageError

SECTIONS = ("model", "data", "heldout", "prune", "calibration", "evaluate", "trainer", "train_data", "val",
            "recovery", "zeroshot")
MAX_VALUES = 100_000


def _count(doc, budget: list[int]) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        return
    if isinstance(doc, dict):
        for k, v in doc.items():
            _count(v, budget)
            if budget[0] < 0:
                return
    elif isinstance(doc, list):
        for v in doc:
            _count(v, budget)
            if budget[0] < 0:
                return


def check_config_doc(doc: dict, path: str) -> None:
    budget = [MAX_VALUES]
    _count(doc, budget)
    if budget[0] < 0:
        raise UsageError(f"Config file {path} expands to more than {MAX_VALUES:,} values (YAML aliases repeated "
                         "inside each other?); write the settings out plainly")
    for name in SECTIONS:
        v = doc.get(name)
        if v is not None and not isinstance(v, (dict, str)):
            raise UsageError(f"Config file {path}: section '{name}' holds a {type(v).__name__}, not a mapping of "
                             f"options (write '{name}: {{option: value}}')")
