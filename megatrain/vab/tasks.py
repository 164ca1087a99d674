"""VAB tasks: one set of matched candidate images with a ground-truth best and worst, and the JSONL loader.

Where it sits: the input of the protocol (protocol.py) and of fine-tuning export (finetune.py). One task per
line, fields as in the released dataset (docs/VAB.md):

    {"task_id": "photograph_landscape_42", "domain": "photograph", "substyle": "landscape",
     "images": ["img/42_a.jpg", "img/42_b.jpg", "img/42_c.jpg"], "labels": ["A", "B", "C"],
     "ground_truth_best": "B", "ground_truth_worst": "C"}

`labels` defaults to A, B, C, ...; `n_images` is optional and checked against `images`. Relative image
paths resolve against `image_root` when one is given (the CLI passes the task file's folder).

Try it: `megatrain vab generate --out tasks.jsonl && python -c
"from megatrain.vab.tasks import load_tasks; print(load_tasks('tasks.jsonl')[0])"`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from .base import MAX_IMAGES, VabModel, letters
from .errors import VabError
from .jsonl import read_models, write_models

TASK_FIX = "see the task format in docs/VAB.md"


class Task(VabModel):
    """A set of 2 to 26 matched candidates; the judge must find the best and the worst."""

    task_id: str = Field(min_length=1, pattern=r"^\S+$", description="unique id; seeds the trial shuffles")
    domain: str = Field(min_length=1, description="e.g. fine-art, illustration, photograph")
    substyle: str = Field(min_length=1, description="e.g. portrait, pixel-art, ink-and-wash")
    images: tuple[str, ...] = Field(min_length=2, max_length=MAX_IMAGES, description="candidate image paths")
    labels: tuple[str, ...] = Field(default=(), description="original label of each image; default A, B, ...")
    ground_truth_best: str = Field(description="label of the best candidate")
    ground_truth_worst: str = Field(description="label of the worst candidate")
    n_images: int | None = Field(default=None, description="optional; must equal len(images)")

    @model_validator(mode="before")
    @classmethod
    def _default_labels(cls, data: object) -> object:
        if isinstance(data, dict) and not data.get("labels") and isinstance(data.get("images"), list | tuple):
            n = len(data["images"])
            if 1 <= n <= MAX_IMAGES:
                data = {**data, "labels": list(letters(n))}
        return data

    @model_validator(mode="after")
    def _check(self) -> Task:
        if len(self.labels) != len(self.images):
            raise ValueError(f"{len(self.labels)} labels for {len(self.images)} images; give one label per image")
        if len(set(self.labels)) != len(self.labels) or not all(self.labels):
            raise ValueError(f"labels {list(self.labels)} must be non-empty and distinct")
        if len(set(self.images)) != len(self.images):
            raise ValueError("an image appears twice in the set; each candidate must be a distinct image")
        if self.n_images is not None and self.n_images != len(self.images):
            raise ValueError(f"n_images is {self.n_images} but {len(self.images)} images are listed")
        for name in ("ground_truth_best", "ground_truth_worst"):
            if getattr(self, name) not in self.labels:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of the labels {list(self.labels)}")
        if self.ground_truth_best == self.ground_truth_worst:
            raise ValueError("ground_truth_best and ground_truth_worst name the same candidate")
        return self

    @property
    def size(self) -> int:
        """Number of candidates (the paper's n_images, the baseline's k)."""
        return len(self.images)

    def image_of(self, label: str) -> str:
        """Image path of the candidate with original label `label`."""
        return self.images[self.labels.index(label)]

    def label_of(self, image: str) -> str:
        """Original label of the candidate showing `image`."""
        return self.labels[self.images.index(image)]


def _resolve(task: Task, root: Path) -> Task:
    images = tuple(img if Path(img).is_absolute() else str(root / img) for img in task.images)
    return Task.model_validate({**task.model_dump(), "images": images})


def load_tasks(path: str | Path, image_root: str | Path | None = None) -> list[Task]:
    """All tasks of a JSONL file, validated; errors name the line and field. Task ids must be unique."""
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for lineno, task in read_models(path, Task, TASK_FIX):
        if task.task_id in seen:
            raise VabError(f"{path}:{lineno}: task_id {task.task_id!r} already used on line {seen[task.task_id]}; "
                           "task ids must be unique")
        seen[task.task_id] = lineno
        tasks.append(task if image_root is None else _resolve(task, Path(image_root)))
    if not tasks:
        raise VabError(f"{path}: holds no tasks; write one task per line ({TASK_FIX})")
    return tasks


def write_tasks(path: str | Path, tasks: list[Task]) -> None:
    """Write tasks as JSONL (the format load_tasks reads)."""
    write_models(path, list(tasks))
