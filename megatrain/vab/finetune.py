"""Fine-tuning data for a judge: the tasks of a training split as prompt/answer pairs.

Where it sits: `megatrain vab export --train TRAIN --eval EVAL --out pairs.jsonl`. Each pair is the exact
prompt a judge sees in a trial (protocol.make_query) and the answer lines it should end with, for each
protocol and each of the task's presentation orders (the orders teach position invariance). 2-image
best+worst pairs are skipped: the protocol never asks them. Leakage guard (check_disjoint): a training
task is refused with a VabError, and nothing is written, when it shares with the evaluation split
- its task id;
- an image path (compared as real paths: symbolic links and `..` resolved);
- an image's content: the sha256 of the file's bytes, so a byte-identical copy under another name is
  caught. This needs every image of both splits on disk; a missing one is an error naming it, unless
  `check_images=False` (`--no-image-check`) limits the guard to ids and paths. Near-duplicates (a resized
  or re-encoded copy) are not caught: no perceptual hash is available without a new dependency.

Try it (synthetic tasks have no image files, hence the flag): `megatrain vab generate --out train.jsonl
--prefix train_ && megatrain vab generate --out eval.jsonl --prefix eval_ && megatrain vab export
--train train.jsonl --eval eval.jsonl --out pairs.jsonl --no-image-check`.
"""

from __future__ import annotations

import hashlib
import os

from megatrain.files import read_regular

from .base import NUM_TRIALS, PROTOCOLS, Protocol, VabModel, letters
from .errors import VabError
from .prompts import format_answer
from .protocol import make_query, trial_orders
from .tasks import Task


class FinetunePair(VabModel):
    """One supervised example: prompt text (with image paths in presented order) and the target answer."""

    task_id: str
    protocol: Protocol
    trial: int
    images: tuple[str, ...]
    prompt: str
    answer: str


MAX_IMAGE_BYTES = 1 << 30  # an image file past 1 GiB is not a benchmark candidate


def image_digest(path: str) -> str:
    """Hex sha256 of the bytes of the image file `path` (a regular file, read whole)."""
    return hashlib.sha256(read_regular(path, MAX_IMAGE_BYTES, "an image file", VabError)).hexdigest()


def _check_images_exist(train: list[Task], eval_tasks: list[Task]) -> None:
    missing = [(split, t.task_id, img) for split, tasks in (("training", train), ("evaluation", eval_tasks))
               for t in tasks for img in t.images if not os.path.exists(img)]
    if missing:
        split, task_id, img = missing[0]
        raise VabError(f"{len(missing)} image file(s) do not exist (first: {img}, of {split} task {task_id!r}), "
                       "so the leak guard cannot compare image contents; fix the image paths or pass "
                       "--no-image-check to compare task ids and image paths only")


def check_disjoint(train: list[Task], eval_tasks: list[Task], check_images: bool = True) -> None:
    """VabError when a training task shares its id, an image path or (with `check_images`) an image's
    bytes with the evaluation split; the error names the first clash and how many there are."""
    eval_ids = {t.task_id for t in eval_tasks}
    clash = sorted(t.task_id for t in train if t.task_id in eval_ids)
    if clash:
        raise VabError(f"{len(clash)} training task id(s) are in the evaluation split (first: {clash[0]!r}); "
                       "remove them from the training file")
    eval_paths = {os.path.realpath(img): (t.task_id, img) for t in eval_tasks for img in t.images}
    shared = [(t.task_id, img) for t in train for img in t.images if os.path.realpath(img) in eval_paths]
    if shared:
        task_id, img = shared[0]
        raise VabError(f"{len({s[0] for s in shared})} training task(s) reuse evaluation images (first: {task_id!r} "
                       f"with {img}, also in evaluation task {eval_paths[os.path.realpath(img)][0]!r}); "
                       "remove them from the training file")
    if not check_images:
        return
    _check_images_exist(train, eval_tasks)
    eval_digests: dict[str, tuple[str, str]] = {}
    for t in eval_tasks:
        for img in t.images:
            eval_digests.setdefault(image_digest(img), (t.task_id, img))
    copies = []
    for t in train:
        for img in t.images:
            found = eval_digests.get(image_digest(img))
            if found is not None:
                copies.append((t.task_id, img, *found))
    if copies:
        task_id, img, eval_id, eval_img = copies[0]
        more = f" ({len(copies) - 1} more such image(s))" if len(copies) > 1 else ""
        raise VabError(f"training image {img} (task {task_id!r}) is byte-identical to evaluation image {eval_img} "
                       f"(task {eval_id!r}){more}; remove the task from the training file")


def export_pairs(train: list[Task], eval_tasks: list[Task], protocols: tuple[Protocol, ...] = PROTOCOLS,
                 orders: int = NUM_TRIALS, check_images: bool = True) -> list[FinetunePair]:
    """Prompt/answer pairs for every training task, protocol and presentation order (after check_disjoint)."""
    if not 1 <= orders <= NUM_TRIALS:
        raise VabError(f"orders is {orders}; use 1 to {NUM_TRIALS} (the protocol's presentation orders)")
    check_disjoint(train, eval_tasks, check_images=check_images)
    pairs = []
    for task in train:
        for protocol in protocols:
            if protocol == "pick_best_and_worst" and task.size == 2:
                continue
            seen: set[tuple[int, ...]] = set()
            for trial, order in enumerate(trial_orders(task.task_id, task.size)[:orders]):
                if order in seen:
                    continue  # NOTE: 2-image shuffles may repeat an order; one copy is enough.
                seen.add(order)
                query = make_query(task, protocol, trial, order)
                shown = dict(zip((task.labels[i] for i in order), letters(task.size)))
                answer = format_answer(protocol, shown[task.ground_truth_best], shown[task.ground_truth_worst])
                pairs.append(FinetunePair(task_id=task.task_id, protocol=protocol, trial=trial,
                                          images=query.images, prompt=query.prompt, answer=answer))
    return pairs
