"""conv12: drop the records of a shipped tuning log that match no task of its workload any more (the
templates changed since it was tuned); the records kept are the original measurements, unchanged.

    PYTHONPATH=. python benchmarks/notes/conv12/prune_shipped.py
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_tune_costmodel import SHIPPED_WORKLOADS, ZNVER3  # noqa: E402

from tvmfuse.tune.tasks import extract_tasks  # noqa: E402

for stem, make in SHIPPED_WORKLOADS.items():
    path = Path("tuning_logs") / f"{stem}.jsonl"
    tasks = {t.key: t.family for t in extract_tasks(make(), ZNVER3)}
    lines = path.read_text().splitlines()
    kept = [ln for ln in lines if (r := json.loads(ln))["workload_key"] in tasks
            and r.get("template", tasks[r["workload_key"]]) == tasks[r["workload_key"]]]
    path.write_text("".join(ln + "\n" for ln in kept))
    print(f"{path}: kept {len(kept)} of {len(lines)} lines; tasks now {tasks}")
