"""Where maps go: sites, spans and the positions of a pruned model. Framework-free.

A *site* is a run of original blocks ``[start, end)`` replaced by one fitted map. With
``granularity="block"`` (the paper's default) every removed block is its own site and the adapters
of adjacent sites are merged exactly afterwards; with ``granularity="span"`` a site is a whole
*span*, a maximal contiguous run of removed blocks. The peers' maps (ReplaceMe, LinearPatch) and the
do-no-harm guard always work per span.

After pruning, the map of a span ``[s, e)`` transforms the hidden state entering the first kept
block after it, whose index in the pruned model is its *position* (:func:`pruned_positions`;
``position == number of kept blocks`` means: entering the final norm).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class Site:
    """Original blocks ``[start, end)`` replaced by one map; ``index``: its place in its list."""

    index: int
    start: int
    end: int

    @property
    def name(self) -> str:
        return f"site {self.index} (blocks {self.start}..{self.end - 1})"

    @property
    def key(self) -> tuple[int, int]:
        return (self.start, self.end)

    @property
    def blocks(self) -> list[int]:
        return list(range(self.start, self.end))


def contiguous_spans(layers: list[int]) -> list[tuple[int, int]]:
    """Sorted indices -> maximal runs ``[(start, end_exclusive), …]``."""
    spans: list[tuple[int, int]] = []
    for i in sorted(layers):
        if spans and spans[-1][1] == i:
            spans[-1] = (spans[-1][0], i + 1)
        else:
            spans.append((i, i + 1))
    return spans


def pruned_positions(num_layers: int, removed: list[int]) -> dict[int, int]:
    """Map each removed original block to the pruned position where its adapter applies."""
    rem = set(removed)
    pos, kept_before = {}, 0
    for i in range(num_layers):
        if i in rem:
            pos[i] = kept_before
        else:
            kept_before += 1
    return pos


def span_sites(removed: list[int]) -> list[Site]:
    """One site per contiguous span of ``removed``."""
    return [Site(k, s, e) for k, (s, e) in enumerate(contiguous_spans(removed))]


def make_sites(removed: list[int], granularity: str) -> list[Site]:
    """The sites of ``removed`` blocks: one per block (``block``) or one per span (``span``)."""
    if granularity == "block":
        return [Site(k, i, i + 1) for k, i in enumerate(sorted(removed))]
    if granularity == "span":
        return span_sites(removed)
    raise ConfigError(f"granularity must be 'block' or 'span', got {granularity!r}")


def sites_in(span: Site, sites: list[Site]) -> list[Site]:
    """The sites inside ``span``, in order."""
    return [s for s in sites if span.start <= s.start and s.end <= span.end]
