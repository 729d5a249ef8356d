"""The research tables' bootstrap summaries (:mod:`experiments.summary`): the robust share a collapsed model cannot
win, and resampled means that are the drawn outcomes' means."""




def test_robust_summary_a_collapsed_model_cannot_win():
    from experiments.summary import Bootstrap

    rng = __import__("numpy").random.default_rng(0)
    n = 300

    def row(acc_vecs, chance):
        return {"tasks": {t: {"metric": "acc", "chance": chance[t],
                              "per_doc": {"doc_ids": list(range(n)), "acc": [int(x) for x in v]}}
                          for t, v in acc_vecs.items()}}

    def exact(share):  # a 0/1 vector with exactly that share of ones, in random order
        v = __import__("numpy").zeros(n, dtype=int)
        v[: round(share * n)] = 1
        return rng.permutation(v)

    chance = {"boolq": 0.62, "arc": 0.25}
    orig = {"boolq": exact(0.40), "arc": exact(0.45)}         # below BoolQ's majority rate: not eligible
    collapsed = {"boolq": exact(0.62),                        # answers "yes" to everything
                 "arc": exact(0.25)}                          # chance on ARC
    rows = {"original": row(orig, chance), "collapsed": row(collapsed, chance)}
    b = Bootstrap(rows, "original", n_boot=500)
    assert b.eligible == ["arc"]
    so, sc = b.summary("original"), b.summary("collapsed")
    assert sc["avg"] > so["avg"]                               # the plain average is won by the collapse
    assert so["robust"] == 1.0 and abs(sc["robust"]) < 0.15    # the robust summary does not
    lo, hi = sc["robust_ci"]
    assert lo <= sc["robust"] <= hi
    d = b.difference("original", "collapsed")
    assert d["robust_diff_ci"][0] > 0.5


    # each row's means are computed once and reused: asking again, in any order, gives the same numbers
    fresh = Bootstrap(rows, "original", n_boot=500)
    assert fresh.difference("original", "collapsed") == d
    assert b.summary("collapsed") == sc == fresh.summary("collapsed")


def test_bootstrap_resampled_means_are_the_drawn_outcomes_means_to_the_bit():
    """The resampled means from draw counts equal the means of the drawn outcomes exactly (0/1 outcomes), and other
    outcomes take the gather."""
    import numpy as np

    from experiments.summary import Bootstrap

    rng = np.random.default_rng(1)
    n = 257
    rows = {name: {"tasks": {t: {"metric": "acc", "chance": 0.25, "per_doc": {
        "doc_ids": list(range(n)), "acc": [int(v) for v in rng.random(n) < p]}} for t in ("a", "b")}}
        for name, p in (("original", 0.6), ("x", 0.4), ("none", 0.0), ("all", 1.01))}
    b = Bootstrap(rows, "original", n_boot=300)
    for name in rows:
        for t in ("a", "b"):
            v = np.asarray(rows[name]["tasks"][t]["per_doc"]["acc"], dtype=np.float64)
            assert np.array_equal(b._resampled(t, v), v[b.idx[t]].mean(1))
    half = np.full(n, 0.5)
    assert np.array_equal(b._resampled("a", half), half[b.idx["a"]].mean(1))
