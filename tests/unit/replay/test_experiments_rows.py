"""``evolving experiments --rows``: labels that hold commas can be asked for."""

from replay.experiments.cli import split_labels
from replay.experiments.matrix import ABLATION

LABELS = {label for label, _stack, _quick in ABLATION}


def test_a_label_with_commas_is_one_row():
    ours = "ours (least-TTFT, async, count-aware)"
    assert ours in LABELS
    assert split_labels(f"{ours},router: cache-aware", LABELS) == [ours, "router: cache-aware"]
    assert split_labels(f"router: cache-aware, {ours}", LABELS) == ["router: cache-aware", ours]


def test_plain_labels_and_unknown_pieces_split_on_commas():
    known = {"evolving", "dynamo", "arrow"}
    assert split_labels("evolving,dynamo, arrow", known) == ["evolving", "dynamo", "arrow"]
    # an unknown piece stays a label of its own, for the caller to name
    assert split_labels("evolving,no such row,dynamo", known) == ["evolving", "no such row", "dynamo"]
    assert split_labels("evolving,,dynamo,", known) == ["evolving", "dynamo"]


def test_the_longest_known_join_wins():
    known = {"a", "a, b", "c"}
    assert split_labels("a, b,c", known) == ["a, b", "c"]
    assert split_labels("a,c", known) == ["a", "c"]
