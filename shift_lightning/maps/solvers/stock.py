"""``stock``: the best repair a stock runtime can run — every map folded exactly into existing weights.

The LRA and the joint map act on the whole residual stream, ``y = x + x Wᵀ + b``: the identity path and the
norms are in the way, so no weight of the model can carry them, and a folder with them needs
``trust_remote_code``. What *does* fold, in the Llama layout (Llama, Mistral, Qwen2, Qwen3: each branch writes
into the stream with no norm after it):

* **The block before the span writes its MLP branch through** ``down_proj``: ``m = u W_downᵀ``, ``u`` the
  down-projection's input (``d_ff`` wide). Whatever that block adds goes straight into the stream entering the
  span, so a new ``down_proj`` ``W' = W_down + W`` makes the block add ``m + Δ̂`` with::

      Δ̂ = u Wᵀ          Wᵀ = (UᵀU + λI)⁻¹ UᵀΔ

  one closed-form ridge regression per span (``λ`` relative to ``mean(diag(UᵀU))``, Cholesky), shrinking
  towards the original ``down_proj``. It contains ReplaceMe's ``m ↦ m T`` exactly (``W = (T − I)ᵀ W_down``, a
  map of rank ≤ d inside the ``d × d_ff`` one), so up to the damping its error is never above ReplaceMe's.
  **No intercept**: a bias would need a bias slot (Llama's ``mlp_bias``), and on held-out calibration windows
  of five SmolLM2 selections it gained at most 0.017 nats (magnitude-L1, random, Taylor), tied under angular and
  moved the model far from the original under Reverse-order* (KL 2.90 against 1.82 without;
  ``experiments/checks/stock_check.py``, ``results/bench/stock_smollm2-135m.md``): a constant added at every
  position, the attention sink's included.
* **A span starting at block 0** has no block before it: the state entering it is the token embedding itself,
  ``x = E[t]``, so the span's LRA ``y = x + x Wᵀ + b`` (fitted as ``lra`` does, on ``(x, Δ)``) folds into the
  embedding table, ``E' = E + E Wᵀ + b``. A tied ``lm_head`` is untied first (it keeps the original table).

After the span, ``--calibration.refit.kept k`` re-fits the first ``k`` kept blocks' linear layers
(:mod:`~shift_lightning.maps.keptfit`): stock weights too. A folder repaired by ``stock`` (with or without the
re-fit) is a plain folder of its family: ``AutoModelForCausalLM.from_pretrained`` without remote code, GGUF,
llama.cpp.

Families with a norm after each branch (Gemma3's ``post_feedforward_layernorm``) cannot fold: the norm fixes
the size of what the branch adds, whatever its weights. ``stock`` refuses them (:meth:`Stock.check_model`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import ConfigError
from .base import Solver, register

if TYPE_CHECKING:
    from torch import nn

    from ..ridge import Solution
    from ...calibration.collect import SiteStatistics

#: Families whose blocks write both branches straight into the stream (no norm after a branch).
FOLDING_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@register
class Stock(Solver):
    name, label = "stock", "+stock (folded into the weights)"
    description = ("maps folded into existing weights (a ridge re-fit of the down_proj before each span, the span "
                   "LRA folded into the embeddings at block 0): a plain folder of its family, no remote code")
    span_only = True
    placement = "down"
    needs = frozenset({"io", "down"})

    def check_model(self, model: nn.Module) -> None:
        """Refuse a family whose weights cannot carry the maps."""
        from ...arch import decoder_layers

        mt = getattr(model.config, "model_type", "?")
        blocks = decoder_layers(model)
        if mt not in FOLDING_FAMILIES or any(hasattr(b, "post_feedforward_layernorm") for b in blocks):
            raise ConfigError(
                f"--calibration.solver stock folds its maps into down_proj, which {mt} cannot hold (a norm after each "
                f"branch, or not a Llama-layout family: stock folds for {', '.join(FOLDING_FAMILIES)}); use "
                "--calibration.solver lra_replaceme (the default; its folder loads with trust_remote_code) or "
                "replaceme")

    def fit(self, stats: SiteStatistics) -> Solution:
        from ..ridge import ridge_solve

        if stats.down is None:  # span at block 0: the span LRA, folded into the embedding table
            sol = ridge_solve(stats.io, self.cfg.damping)
            sol.info = {"fold": "embedding"}
            return sol
        sol = ridge_solve(stats.down, self.cfg.damping, bias=False)
        sol.info = {"fold": "down_proj"}
        return sol

    def fitted_on(self, sol: Solution, stats: SiteStatistics):
        return (stats.io if stats.down is None else stats.down), sol.delta_map()
