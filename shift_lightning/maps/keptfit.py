"""Re-fitting the kept blocks after a pruning site in closed form: ridge regressions, no gradients. Framework-free.

Every map of :mod:`shift_lightning.calibration` sits at the pruning site, a function of the state there; the
kept blocks after it then process a stream that has drifted from the original's. This re-fits the first ``k``
kept blocks after each removed span to absorb that drift: each block's linear layers, one group at a time in the
order the block runs them (q/k/v, o, gate/up, down), by one ridge regression on the corrected pruned model's
inputs, regularised towards the layer's own weights::

    W' = argmin ‖X_p W'ᵀ − Z*‖² + λ‖W' − W‖²        W'ᵀ = (X_pᵀX_p + λI)⁻¹ (X_pᵀZ* + λWᵀ)

with ``λ = δ · mean(diag(X_pᵀX_p))`` (relative damping ``δ``; Cholesky, never an inverse; ``δ → ∞`` leaves the
weights as they were). ``X_p``: the layer's inputs in the corrected pruned model, after the groups before it
were re-fitted. ``Z*``: what the original's layer gives on the original's inputs, ``X_o Wᵀ``; for the two layers
that write into the residual stream (``o_proj``, ``down_proj``) plus the stream's drift, ``Z* = X_o Wᵀ + (h_o −
h_p)``, ``h`` the stream the branch is added to (the block's input for attention, the stream after attention for
the MLP), so that the block's output matches the original's. Without the drift term the targets are met already
up to noise and nothing moves (< 0.1 % KL on SmolLM2): the drift rides the residual connection past every layer.
On an unpruned model (``X_p = X_o``, no drift) nothing changes.

**Llama layout only.** Where a norm sits between a branch and the stream (Gemma3's post-attention and post-MLP
norms, ``n(z) = z / rms(z) · (1 + w)``), the branch adds a vector of fixed size whatever its weights: it cannot
carry the drift, only turn towards it and lose its own signal. Tried with the target taken in the norm's output
space (its direction, at the layer's own scale: ``post_norm="direction"``), it moved Gemma3-270M *away* from the
original on held-out calibration windows under every damping tried (``results/bench/refit_gemma3-270m.md``), so such
blocks are refused (``post_norm="refuse"``, what ``--calibration.refit.kept`` uses).

Statistics per group: ``X_pᵀX_p`` and ``X_pᵀZ*`` in float64 from the real (unpadded) tokens; the walk keeps the
per-batch states of both models (2 · tokens · d floats) and runs each re-fitted block once per group. The
parameter count is unchanged: the re-fitted layers replace the originals.

Every walk is block-major (:class:`Walk`), so the re-fit runs in every placement: onloaded
(``--model.placement onload``) the original is a second skeleton over the same files, each block is read when a walk
reaches it, and a re-fitted block's seven weight matrices are kept on the CPU in the compute dtype and put in place
each time the block is read (the streamed save writes them). The held-out check reads the pruned model from the first
re-fitted block to the head once per tried block.
"""

from __future__ import annotations

import torch

import copy

from ..arch import block_input, block_output, decoder_layers
from ..closeness import TopK, kl_top1_from_hidden, lm_softcap, topk_from_hidden
from ..errors import ShiftError
from ..placement import placement_of

#: The linear layers of a block in the order its forward runs them; each group shares one input.
GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
#: Every re-fitted layer of a block, in that order.
LAYERS = tuple(n for names in GROUPS for n in names)
#: Groups that write into the residual stream (their target carries the stream's drift), and the stream tapped.
WRITES = {1: "in", 3: "mid"}


class KeptFitError(ShiftError, ValueError):
    """A re-fit that cannot run as asked (block layout, damping)."""


class _Stop(Exception):
    """Raised by a hook to end a block's forward once what is needed has been seen."""


def _post_norm(blk, g: int):
    """The norm applied to group ``g``'s output before it is added to the stream (Gemma3), or None (Llama)."""
    if not hasattr(blk, "pre_feedforward_layernorm"):
        return None
    return blk.post_attention_layernorm if g == 1 else blk.post_feedforward_layernorm


def _mid_norm(blk):
    """The module whose input is the stream after attention (the MLP's pre-norm)."""
    return blk.pre_feedforward_layernorm if hasattr(blk, "pre_feedforward_layernorm") else blk.post_attention_layernorm


class Walk:
    """The states of ``windows`` entering block ``at`` of ``model``, per batch of ``batch`` windows, and every block's
    call arguments: blocks run one at a time (block-major), each brought in by the model's placement
    (:mod:`shift_lightning.placement`: in memory a no-op; onloaded, read from the files with its folds and any
    re-fitted weights). The embedding runs once per batch (:class:`~shift_lightning.passes.BlockCache`)."""

    @torch.no_grad()
    def __init__(self, model, windows, first: int = 0, batch: int = 4, device=None):
        from ..passes import BlockCache  # noqa: PLC0415 (the block-major cache; passes imports Lightning)

        self.model, self.blocks, self.placement = model, decoder_layers(model), placement_of(model)
        self.device = torch.device(device) if device is not None else _device(model)
        cache = BlockCache(model, len(self.blocks) - 1)
        self.h, self.masks, self.calls, self.at = [], [], [], 0
        for b in range(0, len(windows), batch):
            am = windows.attention_mask[b:b + batch].to(self.device)
            e = cache.cache_batch({"input_ids": windows.input_ids[b:b + batch].to(self.device), "attention_mask": am},
                                  am.bool(), self.device)
            self.h.append(e["h"])
            self.masks.append(e["mask"])
            self.calls.append(e["calls"])
        cache.entries = []
        self.advance_to(first)

    def block(self):
        """The block the states enter, brought in for the length of a ``with``."""
        return self.placement.block(self.model, self.at, self.device)

    def take(self, other: "Walk") -> "Walk":
        """Start from ``other``'s states (the same windows, a model whose blocks up to ``other.at`` compute exactly as
        this one's: :func:`_shared_prefix`), so those blocks run once for both models."""
        self.h, self.at = list(other.h), other.at
        return self

    def fork(self) -> "Walk":
        """A walk from here on the same states (the states are not copied: blocks make new ones)."""
        other = copy.copy(self)
        other.h = list(self.h)
        return other

    @torch.no_grad()
    def advance_to(self, j: int) -> None:
        """Run blocks ``at .. j − 1`` (with their hooks: adapters apply) so that the states enter block ``j``."""
        while self.at < j:
            i = self.at
            with self.block() as blk:
                self.h = [block_output(blk(h, *self.calls[b][i][0], **self.calls[b][i][1])) for b, h in enumerate(self.h)]
            self.at += 1

    @torch.no_grad()
    def taps(self, blk, b: int, upto: int) -> dict:
        """float64 rows (real tokens) of batch ``b`` at block ``at`` (``blk``: that block, brought in), running the
        block only as far as group ``upto``: for each group ``g ≤ upto`` its input ``(g, "x")``; ``"in"`` (the state
        after any adapter), ``"mid"`` (the stream after attention) and the post-norms' outputs ``(g, "n")``."""
        i = self.at
        got, handles = {}, []

        def keep(key, t):
            got[key] = t

        for g in range(upto + 1):
            lin = blk.get_submodule(GROUPS[g][0])
            handles.append(lin.register_forward_pre_hook(lambda m, a, g=g: keep((g, "x"), a[0])))
            norm = _post_norm(blk, g) if g in WRITES else None

            def stop(m, a, o, g=g, norm=norm):
                if norm is not None:
                    keep((g, "n"), o)
                if g == upto:
                    raise _Stop
            if norm is not None or g == upto:
                handles.append((norm if norm is not None else lin).register_forward_hook(stop))
        handles.append(blk.register_forward_pre_hook(lambda m, a, kw: keep("in", block_input(a, kw)),
                                                     with_kwargs=True))
        handles.append(_mid_norm(blk).register_forward_pre_hook(lambda m, a: keep("mid", a[0])))
        try:
            try:
                blk(self.h[b], *self.calls[b][i][0], **self.calls[b][i][1])
            except _Stop:
                pass
        finally:
            for hd in handles:
                hd.remove()
        return {k: t[self.masks[b]].double() for k, t in got.items()}

    @torch.no_grad()
    def to_head(self, per_window) -> None:
        """Run the remaining blocks, then bring the final norm and the LM head in once and call
        ``per_window(w, hidden, head, softcap)`` for every window ``w`` in order (``hidden``: its real positions after
        the final norm and any adapter in front of it)."""
        self.advance_to(len(self.blocks))
        inner, cap = self.model.model, lm_softcap(self.model)
        with self.placement.piece(inner.norm, "model.norm.", self.device) as norm, \
                self.placement.piece(self.model.get_output_embeddings(), "lm_head.", self.device) as head:
            w = 0
            for h, mask in zip(self.h, self.masks):
                hidden = norm(h)
                for r in range(h.shape[0]):
                    per_window(w, hidden[r][mask[r]], head, cap)
                    w += 1


def _shared_prefix(pruned, original, upto: int) -> int:
    """How many leading blocks (at most ``upto``) ``pruned`` computes exactly as ``original``: the same embedding
    (else none), then block by block the same stored block with nothing on it (no hook, no fold, no weights put over
    it; in memory: equal weights)."""
    pp, po = placement_of(pruned), placement_of(original)

    def same(mp, mo, prefix: str) -> bool:
        if any((m._forward_pre_hooks or m._forward_hooks) for m in (*mp.modules(), *mo.modules())):
            return False
        names_p, names_o = [n for n, _ in mp.named_parameters()], [n for n, _ in mo.named_parameters()]
        if names_p != names_o:
            return False
        if pp.onloaded:
            return all(not pl.folds.get(prefix) and not pl.overrides.get(prefix) for pl in (pp, po)) \
                and all(t.is_meta for t in (*mp.parameters(), *mo.parameters()))
        return all(torch.equal(a, b) for a, b in zip(mp.parameters(), mo.parameters()))

    if not same(pruned.model.embed_tokens, original.model.embed_tokens, "model.embed_tokens."):
        return 0
    bp, bo = decoder_layers(pruned), decoder_layers(original)
    s = 0
    while s < min(upto, len(bp), len(bo)) and (not pp.onloaded or pp.sources[s] == po.sources[s]) \
            and same(bp[s], bo[s], pp.sources[s] if pp.onloaded else ""):
        s += 1
    return s


def _device(model) -> torch.device:
    """Where ``model``'s weights are (an onloaded skeleton's are meta: the CPU)."""
    p = next((p for p in model.parameters() if not p.is_meta), None)
    return p.device if p is not None else torch.device("cpu")


def _norm_target(norm, t: torch.Tensor, z_now: torch.Tensor) -> torch.Tensor:
    """The pre-norm output whose norm points along ``t``, at the current per-token scale of ``z_now``
    (``n(z) = z / rms(z) · (1 + w)`` is scale free: ``t`` fixes the direction, not the size)."""
    u = t / (1.0 + norm.weight.detach().double())
    rms = lambda v: v.pow(2).mean(-1, keepdim=True).clamp_min(torch.finfo(v.dtype).tiny).sqrt()  # noqa: E731
    return u / rms(u) * rms(z_now)


def check_block(blk, where: str, post_norm: str = "refuse") -> None:
    """Refuse a block the re-fit cannot walk (fused projections, other layouts) or, unless ``post_norm`` is
    ``"direction"``, one that adds its branches through norms (Gemma3; see the module doc)."""
    if post_norm == "refuse" and _post_norm(blk, 1) is not None:
        raise KeptFitError(f"{where}: this block adds its branches to the stream through norms (Gemma3's sandwich "
                           "norms), so a re-fitted branch cannot carry the stream's drift (measured: it moves "
                           "Gemma3-270M away from the original); drop --calibration.refit.kept")
    missing = [n for n in LAYERS if not isinstance(_get(blk, n), torch.nn.Linear)]
    if missing or not isinstance(_get(blk, "post_attention_layernorm"), torch.nn.Module):
        raise KeptFitError(f"{where}: the kept-block re-fit needs the Llama block layout (separate "
                           f"{', '.join(missing or ['post_attention_layernorm'])}); this block differs: drop "
                           "--calibration.refit.kept")


def _get(blk, name: str):
    try:
        return blk.get_submodule(name)
    except AttributeError:
        return None


@torch.no_grad()
def refit_kept(pruned, original, windows, pairs: list[tuple[int, int]], damping: float, progress=None,
               post_norm: str = "refuse", reduce=None, device=None) -> list[dict]:
    """Re-fit in place the linear layers of pruned blocks ``p`` (original index ``o``) for each ``(p, o)`` of
    ``pairs`` (ascending), on ``windows`` (see the module doc); ``pruned`` carries its correction (adapters,
    folded maps) already. ``post_norm``: ``"refuse"`` blocks with norms between branch and stream, or fit them
    by ``"direction"`` (measured to hurt; kept for the check that measured it). Returns, per block, each layer's
    relative weight change ``‖W' − W‖ / ‖W‖`` and the number of token rows fitted.

    Across ranks: ``windows`` is this rank's share (none repeated) and ``reduce(tensors)`` sums tensors over ranks
    in place (e.g. :func:`shift_lightning.dist.all_reduce_flat`); each group's statistics are reduced once, after
    its pass over the windows, and every rank then solves the same system (a rank with no windows still takes
    part)."""
    if post_norm not in ("refuse", "direction"):
        raise KeptFitError(f"post_norm must be 'refuse' or 'direction', got {post_norm!r}")
    if not pairs:
        return []
    if not (damping > 0 and damping < float("inf")):
        raise KeptFitError(f"the re-fit's relative damping must be positive and finite, got {damping}")
    blocks = decoder_layers(pruned)
    for p, o in pairs:
        check_block(blocks[p], f"block {o}", post_norm)
    wo = Walk(original, windows, _shared_prefix(pruned, original, pairs[0][0]), device=device)
    wp = Walk(pruned, windows, device=device).take(wo)  # the blocks both compute alike run once
    report = []
    for p, o in pairs:
        wp.advance_to(p)
        wo.advance_to(o)
        with wp.block() as blk, wo.block() as ref_blk:
            report.append(_fit_block(blk, ref_blk, wp, wo, damping, reduce, o, p))
            _keep(pruned, p, blk)
        if progress is not None:
            progress(o)
    return report


def _fit_block(blk, ref_blk, wp: Walk, wo: Walk, damping: float, reduce, o: int, p: int) -> dict:
    """Re-fit ``blk`` (pruned position ``p``, its states in ``wp``) in place against the original's block ``o``
    (``ref_blk``, states in ``wo``), group by group (the module doc's ridge regression)."""
    dev = wp.device
    moved = {}
    rows = torch.zeros((), dtype=torch.float64, device=dev)
    for g, names in enumerate(GROUPS):
        lins = [blk.get_submodule(n) for n in names]
        Ws = [lin.weight.detach().double() for lin in lins]
        d_in = lins[0].in_features
        G = torch.zeros(d_in, d_in, dtype=torch.float64, device=dev)
        C = [torch.zeros(d_in, W.shape[0], dtype=torch.float64, device=dev) for W in Ws]
        for b in range(len(wp.h)):  # statistics per batch: memory bounded by one batch's rows
            ref, mine = wo.taps(ref_blk, b, g), wp.taps(blk, b, g)
            Xp = mine[(g, "x")]
            G += Xp.T @ Xp
            if g == 0:
                rows += Xp.shape[0]
            for i, W in enumerate(Ws):
                Z = ref[(g, "x")] @ W.T
                if g in WRITES:  # the block's output should match the original's: carry the stream's drift
                    drift = ref[WRITES[g]] - mine[WRITES[g]]
                    norm = _post_norm(blk, g)
                    Z = Z + drift if norm is None else _norm_target(norm, ref[(g, "n")] + drift, Xp @ W.T)
                C[i] += Xp.T @ Z
        if reduce is not None:  # one sum over ranks per group, after its pass
            reduce([G, *C] + ([rows] if g == 0 else []))
        if not rows > 0:
            raise KeptFitError(f"block {o}: no calibration tokens to re-fit it on")
        lam = damping * G.diagonal().mean()
        chol = torch.linalg.cholesky(G + lam * torch.eye(G.shape[0], dtype=G.dtype, device=G.device))
        for name, lin, W, Ci in zip(names, lins, Ws, C):
            W_new = torch.cholesky_solve(Ci + lam * W.T, chol).T
            moved[name] = float((W_new - W).norm() / W.norm())
            lin.weight.copy_(W_new.to(lin.weight.dtype))
    return {"block": o, "position": p, "relative_change": moved, "tokens": int(rows.item())}


def _keep(model, p: int, blk) -> None:
    """Onloaded, block ``p``'s re-fitted weights are kept (on the CPU, in the compute dtype) and put in place each
    time the block is read (:meth:`~shift_lightning.placement.Onloaded.override`); in memory the block has them."""
    pl = placement_of(model)
    if pl.onloaded:
        pl.override(pl.sources[p], {f"{n}.weight": blk.get_submodule(n).weight.detach().to("cpu", copy=True)
                                    for n in LAYERS})


def _snapshot(model, p: int):
    """Block ``p``'s re-fittable weights as they are now (onloaded: what is put in place on reading, or None)."""
    pl = placement_of(model)
    if pl.onloaded:
        return pl.overrides.get(pl.sources[p])
    blk = decoder_layers(model)[p]
    return {f"{n}.weight": blk.get_submodule(n).weight.detach().clone() for n in LAYERS}


@torch.no_grad()
def _restore(model, p: int, snap) -> None:
    pl = placement_of(model)
    if pl.onloaded:
        pl.override(pl.sources[p], snap)
        return
    blk = decoder_layers(model)[p]
    for name, w in snap.items():
        blk.get_parameter(name).copy_(w)


def refit_pairs(layers: list[int], n: int, k: int | str) -> list[tuple[int, int]]:
    """``(pruned index, original index)`` of the first ``k`` kept blocks after each removed span (``"all"``: every
    kept block after it)."""
    k = None if k == "all" else k
    removed = set(layers)
    keep = [i for i in range(n) if i not in removed]
    pos = {o: p for p, o in enumerate(keep)}
    ends = [i + 1 for i in sorted(removed) if i + 1 not in removed]  # each span's end (exclusive)
    return sorted({(pos[o], o) for end in ends for o in [o for o in keep if o >= end][:k]})


def references(walk: Walk, k: int) -> dict[int, TopK]:
    """The (original) model's top-``k`` next-token distribution at every real position of each of ``walk``'s windows
    (keyed by window), each block brought in once."""
    out = {}
    walk.to_head(lambda w, hidden, head, cap: out.__setitem__(w, topk_from_hidden(hidden, head, k, cap)))
    return out


def heldout_kl(walk: Walk, refs: dict[int, TopK], reduce=None) -> float:
    """Mean next-token KL(original ‖ the walk's model) over every real position of its windows, run from where the
    walk stands to the head (``refs``: :func:`references` of the original on the same windows; across ranks, this
    rank's share and ``reduce``)."""
    tot = torch.zeros(3, dtype=torch.float64, device=walk.device)  # Σ KL, Σ agreement, positions

    def add(w, hidden, head, cap):
        kl, agree = kl_top1_from_hidden(hidden, head, refs[w], cap)
        n = torch.tensor(float(kl.numel()), dtype=torch.float64, device=kl.device)
        tot.add_(torch.stack([kl.double().sum(), agree.double().sum(), n]).to(tot.device))

    walk.to_head(add)
    if reduce is not None:
        reduce([tot])
    if not tot[2] > 0:
        raise KeptFitError("the re-fit's held-out check has no real positions to compare (every window empty)")
    return (tot[0] / tot[2]).item()


@torch.no_grad()
def guarded_refit(pruned, original, windows, pairs: list[tuple[int, int]], damping: float, every: int = 4,
                  topk: int = 64, progress=None, rank: int = 0, world: int = 1, reduce=None, device=None) -> dict:
    """The re-fit with a do-no-harm check: every ``every``-th window is held out; block after block (in order,
    earlier kept re-fits in place), the block is re-fitted on the other windows and kept only if the model gets
    closer to the original on the held-out ones (mean KL over the original's top-``topk``); the kept blocks are
    then re-fitted on all windows. Returns ``{"heldout_kl": {"none": …, "<block>": …}, "kept": [blocks],
    "blocks": refit_kept's report}``.

    Block-major in every placement (:class:`Walk`): the fitting windows walk both models up to each re-fitted block;
    the held-out windows walk the pruned model once up to the first of them and, for each check, from there to the
    head. Onloaded, ``original`` is a second skeleton over the same files (no copy of the model) and each block is
    read when a walk reaches it.

    Across ``world`` ranks: ``windows`` are all of them (the same on every rank); the held-out split is made on
    them, then each part is shared out (rank ``r`` takes windows ``r, r + world, …`` of it, none repeated) and
    statistics and scores are summed with ``reduce`` (see :func:`refit_kept`), so every rank keeps the same
    blocks and ends with the same weights as one process would."""
    from ..data import TokenWindows  # noqa: PLC0415 (data: torch only)

    if len(windows) < every:
        raise KeptFitError(f"the re-fit's held-out check needs at least {every} calibration windows (every "
                           f"{every}th is held out), got {len(windows)}: add windows (--data.num_samples)")
    if world > 1 and reduce is None:
        raise KeptFitError(f"a re-fit shared out over {world} ranks needs reduce (a sum over ranks)")

    def share(keep: torch.Tensor):
        idx = keep.nonzero().flatten()[rank::world]
        return TokenWindows(windows.input_ids[idx], windows.attention_mask[idx])

    held = torch.arange(len(windows)) % every == every - 1
    fit, judge, mine = share(~held), share(held), share(torch.ones_like(held))
    blocks = decoder_layers(pruned)
    for p, o in pairs:
        check_block(blocks[p], f"block {o}")
    jw, refs, wp, wo = _guard_walks(pruned, original, fit, judge, pairs[0][0], topk, device)
    best = heldout_kl(jw.fork(), refs, reduce)
    scores, kept, saved = {"none": best}, [], {}
    for p, o in pairs:
        before = _snapshot(pruned, p)
        wp.advance_to(p)
        wo.advance_to(o)
        jw.advance_to(p)
        with wp.block() as blk, wo.block() as ref_blk:
            _fit_block(blk, ref_blk, wp, wo, damping, reduce, o, p)
            _keep(pruned, p, blk)
        scores[str(o)] = kl = heldout_kl(jw.fork(), refs, reduce)
        if kl < best:
            best, saved[(p, o)] = kl, before
            kept.append((p, o))
        else:
            _restore(pruned, p, before)
        if progress is not None:
            progress(o, kl, kl == best)
    del wp, wo, jw
    for (p, _), before in saved.items():  # the kept blocks again, from their own weights, on all windows
        _restore(pruned, p, before)
    return {"heldout_kl": scores, "kept": [o for _, o in kept],
            "blocks": refit_kept(pruned, original, mine, kept, damping, reduce=reduce, device=device)}


def _guard_walks(pruned, original, fit, judge, first: int, topk: int, device):
    """The guard's walks: the held-out windows' pruned walk up to block ``first`` and the original's top-``topk``
    references on them, and the fitting windows' walks of both models; the blocks both compute alike
    (:func:`_shared_prefix`) run once for both."""
    shared = _shared_prefix(pruned, original, first)
    ref_walk = Walk(original, judge, shared, device=device)
    jw = Walk(pruned, judge, device=device).take(ref_walk)
    refs = references(ref_walk, topk)
    jw.advance_to(first)
    wo = Walk(original, fit, shared, device=device)
    return jw, refs, Walk(pruned, fit, device=device).take(wo), wo


def kept_tensors(model, positions: list[int]) -> dict[str, torch.Tensor]:
    """The re-fitted layers of the pruned blocks at ``positions``, keyed ``kept.<position>.<layer>.weight`` (what
    an adapter-only folder stores besides its adapters)."""
    pl, out = placement_of(model), {}
    for p in positions:
        with pl.block(model, p) as blk:
            out.update({f"kept.{p}.{n}.weight": blk.get_submodule(n).weight.detach().contiguous().cpu()
                        for n in LAYERS})
    return out


@torch.no_grad()
def put_kept_tensors(model, tensors: dict[str, torch.Tensor]) -> None:
    """Put :func:`kept_tensors`' weights in place in ``model`` (rebuilt from the base; run after any folded map)."""
    blocks = decoder_layers(model)
    for key, t in tensors.items():
        p, name = key.split(".", 2)[1:]
        try:
            w = blocks[int(p)].get_submodule(name.removesuffix(".weight")).weight
        except (AttributeError, IndexError, ValueError) as e:
            raise KeptFitError(f"{key} names no layer of the rebuilt model ({e})") from e
        if w.shape != t.shape:
            raise KeptFitError(f"{key} has shape {tuple(t.shape)}, the base model's layer {tuple(w.shape)}: the "
                               "folder does not belong to this base model")
        w.copy_(t.to(w.dtype))
