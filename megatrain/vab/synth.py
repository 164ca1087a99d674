"""Synthetic VAB task sets and score files, for trying the pipeline and for tests (no images needed).

Where it sits: `megatrain vab generate` writes what these functions build. Image paths are placeholders
(`images/<task_id>/<label>.jpg`); reference judges never open them. Ground truth is drawn uniformly
unless `best_position` pins the best candidate to one position of the original order, which mimics a
data set whose curators tend to list the best first (it makes position bias visible).

Try it: `megatrain vab generate --out tasks.jsonl --n 90 --scores scores.jsonl`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .base import MAX_IMAGES, letters
from .errors import VabError
from .judges import ScoreLine
from .tasks import Task

DOMAINS = {"fine-art": ("ink-and-wash", "calligraphy", "portrait"),
           "illustration": ("anime-manga", "pixel-art"),
           "photograph": ("landscape-color", "macro", "portrait")}


def generate_tasks(n: int, sizes: Sequence[int] = (2, 3, 4), seed: int = 0,
                   best_position: int | None = None, prefix: str = "") -> list[Task]:
    """`n` tasks cycling through `sizes` and the three domains, with random ground truth."""
    if n < 1:
        raise VabError(f"cannot generate {n} tasks; ask for at least 1")
    if not sizes or any(not 2 <= k <= MAX_IMAGES for k in sizes):
        raise VabError(f"set sizes {list(sizes)} must each be 2 to {MAX_IMAGES}")
    if best_position is not None and best_position >= min(sizes):
        raise VabError(f"best_position {best_position} does not exist in a {min(sizes)}-image set; "
                       f"use 0 to {min(sizes) - 1}")
    rng = random.Random(seed)
    domains = sorted(DOMAINS)
    tasks = []
    for i in range(n):
        k = sizes[i % len(sizes)]
        domain = domains[(i // len(sizes)) % len(domains)]
        substyle = rng.choice(DOMAINS[domain])
        task_id = f"{prefix}{domain}_{substyle}_{i:04d}"
        labels = letters(k)
        best = labels[best_position] if best_position is not None else rng.choice(labels)
        worst = rng.choice([la for la in labels if la != best])
        tasks.append(Task(task_id=task_id, domain=domain, substyle=substyle, labels=labels,
                          images=tuple(f"images/{task_id}/{la}.jpg" for la in labels),
                          ground_truth_best=best, ground_truth_worst=worst, n_images=k))
    return tasks


def synthetic_scores(tasks: Sequence[Task], noise: float = 1.0, seed: int = 0) -> list[ScoreLine]:
    """Per-candidate scores that track the ground truth: best 2, worst 0, others 1, plus Gaussian noise."""
    rng = random.Random(seed)
    lines = []
    for task in tasks:
        scores = {}
        for label in task.labels:
            mean = 2.0 if label == task.ground_truth_best else 0.0 if label == task.ground_truth_worst else 1.0
            scores[label] = round(mean + rng.gauss(0.0, noise), 4)
        lines.append(ScoreLine(task_id=task.task_id, scores=scores))
    return lines
