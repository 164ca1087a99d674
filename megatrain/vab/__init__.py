"""megatrain.vab: the Visual Aesthetic Benchmark (VAB) protocol for any judge, independent of training.

Where it sits: a self-contained package (folder megatrain/vab/, docs in docs/VAB.md; its own command, `megatrain-vab`). A judge sees a set of
matched candidates in three orders and names the best and/or worst; a task counts (pass^3) only when the
answer holds in all three. Pipeline: tasks.py (JSONL tasks) -> judges.py / command_judge.py / specs.py
(who answers) -> protocol.py (orders, mapping back, scoring) -> runner.py (resumable results file) ->
metrics.py / report.py (pass^3, ap@1, baselines, intervals); agreement.py (scores vs direct comparison)
and finetune.py (training pairs) sit beside it; cli.py is `megatrain vab`.

Try it: `megatrain vab generate --out t.jsonl && megatrain vab run --tasks t.jsonl --judge
random --out r.jsonl && megatrain vab report r.jsonl`.
"""

from .agreement import HumanLabel, analyze_agreement, compare_runs, kendall_tau, load_human_labels, mcnemar
from .base import DEFAULT_PARSE, NUM_TRIALS, PARSE_MODES, PROTOCOLS, ParseMode, Protocol
from .command_judge import CommandJudge
from .errors import VabError
from .finetune import FinetunePair, check_disjoint, export_pairs
from .judges import (
    Candidate,
    Judge,
    JudgeAnswer,
    JudgeQuery,
    OracleJudge,
    PositionJudge,
    RandomJudge,
    ScoreJudge,
    load_scores,
)
from .metrics import VabReport, bootstrap_ci, build_report, random_baseline
from .prompts import build_prompt, parse_answer
from .protocol import TrialResult, pick_best, pick_best_and_worst, pick_worst, run_trial, trial_orders
from .runner import evaluate, load_results, run_eval
from .specs import make_judge
from .synth import generate_tasks
from .tasks import Task, load_tasks, write_tasks

__all__ = [
    "DEFAULT_PARSE", "NUM_TRIALS", "PARSE_MODES", "PROTOCOLS", "Candidate", "CommandJudge", "FinetunePair",
    "HumanLabel", "Judge", "JudgeAnswer", "JudgeQuery", "OracleJudge", "ParseMode", "PositionJudge",
    "Protocol", "RandomJudge", "ScoreJudge", "Task", "TrialResult", "VabError", "VabReport",
    "analyze_agreement", "bootstrap_ci", "build_prompt", "build_report", "check_disjoint", "compare_runs",
    "evaluate", "export_pairs", "generate_tasks", "kendall_tau", "load_human_labels", "load_results",
    "load_scores", "load_tasks", "make_judge", "mcnemar", "parse_answer", "pick_best", "pick_best_and_worst",
    "pick_worst", "random_baseline", "run_eval", "run_trial", "trial_orders", "write_tasks",
]
