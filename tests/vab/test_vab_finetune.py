"""Fine-tuning export: prompt/answer pairs of the training split; any overlap with evaluation is refused:
task ids, image paths (real paths) and image contents (sha256 of the bytes)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from megatrain.vab.errors import VabError
from megatrain.vab.finetune import check_disjoint, export_pairs, image_digest
from megatrain.vab.judges import JudgeAnswer
from megatrain.vab.prompts import parse_answer
from megatrain.vab.protocol import make_query, score_answer
from megatrain.vab.synth import generate_tasks


def test_pairs_answer_the_prompt_correctly():
    train = generate_tasks(9, sizes=(2, 3, 4), seed=1, prefix="train_")
    eval_tasks = generate_tasks(5, seed=2, prefix="eval_")
    pairs = export_pairs(train, eval_tasks, check_images=False)  # synthetic tasks: no image files
    by_id = {t.task_id: t for t in train}
    assert {p.task_id for p in pairs} == set(by_id)
    assert not any(p.protocol == "pick_best_and_worst" and by_id[p.task_id].size == 2 for p in pairs)
    for pair in pairs:
        task = by_id[pair.task_id]
        order = tuple(task.images.index(img) for img in pair.images)
        assert make_query(task, pair.protocol, pair.trial, order).prompt == pair.prompt
        best, worst = parse_answer(pair.answer, pair.protocol, tuple("ABCD"[: task.size]), "strict")
        scored = score_answer(task, pair.protocol, pair.trial, order, JudgeAnswer(best=best, worst=worst), "x")
        assert scored.correct
    three = [p for p in pairs if by_id[p.task_id].size == 3 and p.protocol == "pick_best"]
    assert len(three) == 3 * 3  # three 3-image tasks, three distinct orders each
    assert len(export_pairs(train, eval_tasks, protocols=("pick_worst",), orders=1, check_images=False)) == 9


def test_overlap_with_evaluation_split_is_refused():
    train = generate_tasks(6, seed=1)
    with pytest.raises(VabError, match=r"6 training task id\(s\) are in the evaluation split"):
        export_pairs(train, train[:])
    renamed = [t.model_validate({**t.model_dump(), "task_id": "copy_" + t.task_id}) for t in train[:1]]
    with pytest.raises(VabError, match="reuse evaluation images"):
        export_pairs(renamed, train)
    with pytest.raises(VabError, match="orders is 4"):
        export_pairs(train, [], orders=4)


def _with_images(tmp_path, name: str, tasks, content=lambda task, label: f"{task.task_id}/{label}"):
    """`tasks` with their images written under tmp_path/name, each file holding `content(task, label)`."""
    out = []
    for task in tasks:
        images = []
        for label in task.labels:
            path = tmp_path / name / f"{task.task_id}_{label}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content(task, label).encode())
            images.append(str(path))
        out.append(task.model_validate({**task.model_dump(), "images": images}))
    return out


def test_distinct_images_on_disk_pass_the_content_check(tmp_path):
    train = _with_images(tmp_path, "train", generate_tasks(3, seed=1, prefix="train_"))
    eval_tasks = _with_images(tmp_path, "eval", generate_tasks(3, seed=2, prefix="eval_"))
    check_disjoint(train, eval_tasks)
    assert export_pairs(train, eval_tasks)


def test_a_byte_identical_renamed_image_is_refused_naming_both_files(tmp_path):
    train = _with_images(tmp_path, "train", generate_tasks(3, seed=1, prefix="train_"))
    eval_tasks = _with_images(tmp_path, "eval", generate_tasks(3, seed=2, prefix="eval_"))
    copied = Path(train[1].images[2])
    copied.write_bytes(Path(eval_tasks[2].images[0]).read_bytes())  # same bytes, another name and folder
    with pytest.raises(VabError) as info:
        check_disjoint(train, eval_tasks)
    message = str(info.value)
    assert f"training image {copied} (task {train[1].task_id!r}) is byte-identical to evaluation image " \
           f"{eval_tasks[2].images[0]} (task {eval_tasks[2].task_id!r})" in message
    assert "remove the task from the training file" in message and "\n" not in message
    check_disjoint(train, eval_tasks, check_images=False)  # ids and paths alone cannot see it
    assert image_digest(str(copied)) == hashlib.sha256(copied.read_bytes()).hexdigest()


def test_a_linked_or_dotted_path_to_an_evaluation_image_is_refused(tmp_path):
    train = generate_tasks(1, sizes=(2,), seed=1, prefix="train_")
    eval_tasks = _with_images(tmp_path, "eval", generate_tasks(1, sizes=(2,), seed=2, prefix="eval_"))
    link = tmp_path / "link.jpg"
    link.symlink_to(eval_tasks[0].images[1])
    dotted = str(tmp_path / "eval" / ".." / "eval" / Path(eval_tasks[0].images[0]).name)
    train = [train[0].model_validate({**train[0].model_dump(), "images": [str(link), dotted]})]
    with pytest.raises(VabError, match=r"1 training task\(s\) reuse evaluation images .first: 'train_"):
        check_disjoint(train, eval_tasks, check_images=False)


def test_missing_images_are_refused_unless_the_check_is_off(tmp_path):
    train = _with_images(tmp_path, "train", generate_tasks(2, seed=1, prefix="train_"))
    eval_tasks = generate_tasks(2, seed=2, prefix="eval_")  # placeholder paths, no files
    with pytest.raises(VabError) as info:
        check_disjoint(train, eval_tasks)
    message = str(info.value)
    assert message.startswith(f"{sum(t.size for t in eval_tasks)} image file(s) do not exist (first: "
                              f"{eval_tasks[0].images[0]}, of evaluation task {eval_tasks[0].task_id!r})")
    assert "pass --no-image-check" in message
    assert export_pairs(train, eval_tasks, check_images=False)
