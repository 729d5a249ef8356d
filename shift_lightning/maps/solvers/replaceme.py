"""ReplaceMe (arXiv 2505.02819; mts-ai/ReplaceMe): a map ``T`` on the MLP branch of the last kept block.

With ``m`` the MLP-branch output of block ``s − 1`` and ``Δ`` what the span ``[s, e)`` adds to the
residual stream, ReplaceMe replaces ``m`` by ``m T`` so that block ``s − 1`` alone produces
``h_e ≈ x + Δ``: the target of ``m T`` is ``m + Δ``. ``T`` is folded into ``down_proj``
(:func:`~shift_lightning.maps.peers.fold_replaceme`), so the corrected model is a stock HF model. A span
starting at block 0 has no block to fold into and stays uncorrected.

* ``replaceme``: least squares, ``T = (mᵀm + λI)⁻¹ mᵀ(m + Δ)`` (its ``lstsq.py``), as
  ``ridge_solve(kind="affine", bias=False)`` on the statistics of ``(m, Δ)`` (``A = Tᵀ``). On
  purpose unlike the reference: padding is masked out of ``mᵀm`` and the solve is Cholesky with
  relative damping instead of ``inv`` at α = 0.
* ``replaceme_cosine``: the paper's strongest training-free variant (its Tables 2 and 5; the repo's
  ``cosine_dist.py`` + ``utils.adam_method`` defaults): ``T`` starts at the identity and Adam
  (lr 1e-4, 1024 tokens a step, 10 epochs over the cached tokens, reshuffled each epoch) minimises
  ``1 − mean_t cos(m_t T, m_t + Δ_t)`` over the calibration tokens (float32, seeded order, padding
  masked; the reference keeps padding rows). The cached rows are capped at
  ``--calibration.replaceme_cosine.max_tokens``; its knobs are :class:`CosineKnobs`
  (``--calibration.replaceme_cosine.*``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import ConfigError
from .base import Solver, register

# No imports for type checking only in this module: jsonargparse runs them when it reads the knobs' dataclass for
# ``--help``, which must not import torch (the solver's signatures are the base class's).


@dataclass
class CosineKnobs:
    """``replaceme_cosine``'s Adam fit on cached activations (``--calibration.replaceme_cosine.*``; the defaults are
    ReplaceMe's)."""

    epochs: int = 10
    """Passes of Adam over the cached activations."""
    lr: float = 1e-4
    """Adam's learning rate."""
    batch_tokens: int = 1024
    """Tokens per Adam step."""
    max_tokens: int = 262144
    """At most this many calibration tokens cached per span (two float32 rows of d each: 8·d bytes a token)."""
    seed: int = 0
    """Seed of the data order."""

    def validate(self) -> None:
        """Cheap checks (before any model is loaded)."""
        for name in ("epochs", "batch_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--calibration.replaceme_cosine.{name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--calibration.replaceme_cosine.lr must be a finite number > 0, got {self.lr}")


@register
class ReplaceMe(Solver):
    name, label = "replaceme", "+ReplaceMe"
    description = "ReplaceMe (least squares) maps on the MLP branch of the block before each span"
    span_only = True
    placement = "branch"
    needs = frozenset({"branch"})

    def applies(self, site) -> bool:
        return site.start >= 1

    def fit(self, stats):
        from ..ridge import ridge_solve

        return ridge_solve(stats.branch, self.cfg.damping, None, "affine", bias=False)


def cosine_fit(m, y, epochs: int = 10, lr: float = 1e-4, batch_tokens: int = 1024, seed: int = 0,
               device=None) -> tuple:
    """``T: (d, d)`` float64 minimising ``1 − mean cos(m T, y)`` by Adam from ``T = I`` (see module doc);
    ``m, y``: ``(N, d)`` tensors. Returns ``T`` (a tensor) and the mean loss of each epoch."""
    import torch

    d = m.shape[1]
    dev = device or m.device
    lin = torch.nn.Linear(d, d, bias=False, device=dev, dtype=torch.float32)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(d))
    opt = torch.optim.Adam(lin.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    history = []
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(m.shape[0], generator=gen)
            total, steps = 0.0, 0
            for s in range(0, m.shape[0], batch_tokens):
                idx = order[s:s + batch_tokens]
                xb, yb = m[idx].to(dev, torch.float32), y[idx].to(dev, torch.float32)
                out = lin(xb)  # m T with T = weightᵀ
                loss = 1 - torch.nn.functional.cosine_similarity(out, yb, dim=1, eps=1e-12).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total, steps = total + float(loss.detach()), steps + 1
            history.append(total / max(steps, 1))
    return lin.weight.detach().T.double(), history


@register
class ReplaceMeCosine(ReplaceMe):
    name, label = "replaceme_cosine", "+ReplaceMe (cosine)"
    description = "ReplaceMe (cosine objective, Adam on cached activations) maps on the MLP branch of the block before each span"
    needs = frozenset({"branch", "rows"})

    def fit(self, stats):
        import torch

        from ..ridge import Solution, SolveError

        m, y = stats.rows.gather()
        if m.shape[0] == 0:

            raise SolveError(f"{stats.site.name}: no calibration tokens were cached for ReplaceMe's cosine fit")
        c = self.cfg.replaceme_cosine
        T, history = cosine_fit(m, y, c.epochs, c.lr, c.batch_tokens, c.seed, self.device)
        d = T.shape[0]
        zero = torch.zeros(d, dtype=torch.float64, device=T.device)
        return Solution(T.T.contiguous(), zero, None, None, 0.0, "affine",
                        info={"cosine_loss": history, "tokens": int(m.shape[0]),
                              "steps": c.epochs * -(-m.shape[0] // c.batch_tokens)})
