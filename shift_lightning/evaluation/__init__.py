"""Evaluation: lm-eval-compatible zero-shot scoring, perplexity, Lightning callbacks.

``scoring`` (batched log-likelihood core) and ``tasks`` (harness task definitions + local data)
are framework-free; ``runner``/``callbacks`` orchestrate them with Lightning/torchmetrics.
"""

from .callbacks import Perplexity, ZeroShotAccuracy
from .runner import EvalConfig, EvalModule, Evaluator, evaluate_model, markdown_table
from .tasks import DEFAULT_TASKS, TASKS, TaskError, load_docs, parse_tasks

__all__ = [
    "DEFAULT_TASKS", "TASKS", "EvalConfig", "EvalModule", "Evaluator", "Perplexity", "TaskError",
    "ZeroShotAccuracy", "evaluate_model", "load_docs", "markdown_table", "parse_tasks",
]
