"""tvmfuse's autotuner: task extraction, crash-safe measurement (local or through TVM's RPC tracker), an
XGBoost ranking cost model, the search over each template's knob space, and JSON-lines tuning logs.

    from tvmfuse.tune import tune
    result = tune("model.onnx", target=None, trials=200, log_path="model.jsonl")
    ex = tvm.compile(mod, target, relax_pipeline=tvmfuse.pipeline(target, tuning_log="model.jsonl"))
"""
from __future__ import annotations

from .log import best_configs, load, merge, summary
from .measure import MeasureOptions
from .search import TuneOptions, TuneResult, Tuner, tune
from .tasks import Task, extract_tasks, task_for

__all__ = ["tune", "Tuner", "TuneOptions", "TuneResult", "MeasureOptions", "Task", "extract_tasks", "task_for",
           "best_configs", "load", "merge", "summary"]
