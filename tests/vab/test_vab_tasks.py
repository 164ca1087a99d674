"""Task format: valid files load; malformed files fail with errors that name the line and the field."""

from __future__ import annotations

import pytest
from vab_testing import write_lines

from megatrain.vab.errors import VabError
from megatrain.vab.tasks import Task, load_tasks, write_tasks

GOOD = {"task_id": "photo_1", "domain": "photograph", "substyle": "macro", "images": ["a.jpg", "b.jpg", "c.jpg"],
        "labels": ["A", "B", "C"], "ground_truth_best": "B", "ground_truth_worst": "C"}


def test_round_trip(tmp_path, small_tasks):
    path = tmp_path / "t.jsonl"
    write_tasks(path, small_tasks)
    assert load_tasks(path) == small_tasks


def test_labels_default_to_letters_and_image_root_resolves(tmp_path):
    row = {k: v for k, v in GOOD.items() if k != "labels"}
    path = write_lines(tmp_path / "t.jsonl", [row])
    (task,) = load_tasks(path, image_root=tmp_path)
    assert task.labels == ("A", "B", "C")
    assert task.images[0] == str(tmp_path / "a.jpg")
    assert task.image_of("B") == str(tmp_path / "b.jpg") and task.label_of(task.images[2]) == "C"


def test_vab_error_is_a_value_error():
    assert issubclass(VabError, ValueError)


@pytest.mark.parametrize("change, words", [
    ({"ground_truth_best": "Q"}, ["line 2", "ground_truth_best 'Q' is not one of the labels"]),
    ({"ground_truth_worst": "B"}, ["line 2", "same candidate"]),
    ({"images": ["a.jpg"], "labels": ["A"]}, ["line 2", "field 'images'", "at least 2"]),
    ({"labels": ["A", "B"]}, ["line 2", "2 labels for 3 images"]),
    ({"labels": ["A", "A", "C"]}, ["line 2", "distinct"]),
    ({"images": ["a.jpg", "a.jpg", "c.jpg"]}, ["line 2", "appears twice"]),
    ({"n_images": 4}, ["line 2", "n_images is 4"]),
    ({"task_id": "has space"}, ["line 2", "field 'task_id'"]),
    ({"colour": "red"}, ["line 2", "field 'colour'", "Extra inputs"]),
    ({"domain": None}, ["line 2", "field 'domain'"]),
])
def test_malformed_task_names_line_and_field(tmp_path, change, words):
    bad = {**GOOD, "task_id": "photo_2", **change}
    path = write_lines(tmp_path / "t.jsonl", [GOOD, bad])
    with pytest.raises(VabError) as info:
        load_tasks(path)
    message = str(info.value).replace(":2:", " line 2:")
    for word in words:
        assert word in message, message
    assert "docs/VAB.md" in str(info.value)


def test_missing_field_is_named(tmp_path):
    row = {k: v for k, v in GOOD.items() if k != "ground_truth_worst"}
    path = write_lines(tmp_path / "t.jsonl", [row])
    with pytest.raises(VabError, match=r"t.jsonl:1: field 'ground_truth_worst': Field required"):
        load_tasks(path)


def test_bad_json_duplicate_ids_and_empty_files(tmp_path):
    with pytest.raises(VabError, match=r":2: not valid JSON"):
        load_tasks(write_lines(tmp_path / "a.jsonl", [GOOD, '{"task_id": "x",']))
    with pytest.raises(VabError, match=r":1: expected a JSON object"):
        load_tasks(write_lines(tmp_path / "b.jsonl", ["[1, 2]"]))
    with pytest.raises(VabError, match=r":3: task_id 'photo_1' already used on line 1"):
        load_tasks(write_lines(tmp_path / "c.jsonl", [GOOD, "", GOOD]))
    with pytest.raises(VabError, match="holds no tasks"):
        load_tasks(write_lines(tmp_path / "d.jsonl", [""]))
    with pytest.raises(VabError, match="no such file"):
        load_tasks(tmp_path / "missing.jsonl")


def test_task_model_is_frozen():
    task = Task.model_validate(GOOD)
    with pytest.raises(Exception):  # noqa: B017 - pydantic raises ValidationError on frozen assignment
        task.domain = "x"
    assert task.size == 3
