"""The fault tests' witness counts what a user would call a wrong mark, and nothing else: it
must be able to fail them."""

from __future__ import annotations

from typing import Any

from tests.witness import Seen, Witness

USES = {"u-train": "ProcessesRunning", "u-sneak": "UsingUnrequestedGPU"}


def _witness(conditions: list[Seen], events: dict[str, tuple[str, str, int]]) -> Witness:
    api: Any = None  # never started: only what it saw is judged
    return Witness(api, "faults", conditions=conditions, events=events)


def test_true_marks_unknown_while_a_part_is_away_and_one_start_are_not_wrong() -> None:
    seen = [
        Seen("train", "u-train", "True", "ProcessesRunning"),
        Seen("train", "u-train", "Unknown", "ReportStale"),
        Seen("train", "u-train", "True", "ProcessesRunning"),
        Seen("sneak", "u-sneak", "True", "UsingUnrequestedGPU"),
    ]
    events = {
        "e1": ("u-train", "GPUUseStarted", 1),
        "e2": ("u-sneak", "UsingUnrequestedGPU", 1),
    }
    assert _witness(seen, events).wrong_marks(USES, set(USES)) == []


def test_each_kind_of_wrong_mark_is_counted() -> None:
    seen = [
        Seen("train", "u-train", "False", "ProcessesEnded"),  # stopped, while it ran
        Seen("train", "u-train", "True", "UsingUnrequestedGPU"),  # flagged, not misusing
        Seen("sneak", "u-sneak", "True", "ProcessesRunning"),  # its flag lost
    ]
    events = {
        "e1": ("u-train", "GPUUseStarted", 1),
        "e2": ("u-train", "GPUUseStarted", 1),  # a second start
        "e3": ("u-train", "GPUUseEnded", 1),
        "e4": ("u-sneak", "UsingUnrequestedGPU", 2),  # flagged again, as a series
    }
    wrong = _witness(seen, events).wrong_marks(USES, set(USES))
    assert sorted(wrong) == sorted(
        [
            "train marked False ProcessesEnded",
            "train marked UsingUnrequestedGPU, not ProcessesRunning",
            "sneak marked ProcessesRunning, not UsingUnrequestedGPU",
            "pod u-train: GPUUseStarted 2 times, counted [1, 1]",
            "pod u-train: GPUUseEnded while it ran",
            "pod u-sneak: flagged again after the fault [('UsingUnrequestedGPU', 2)]",
        ]
    )
    flagged = {"e5": ("u-train", "UsingUnrequestedGPU", 1)}  # an Event flagging the trainer
    assert _witness([], flagged).wrong_marks(USES, set(USES)) == [
        "pod u-train: flagged [('UsingUnrequestedGPU', 1)], its use is ProcessesRunning"
    ]


def test_a_pod_that_did_not_run_all_along_is_not_held_to_it() -> None:
    seen = [Seen("old", "u-old", "False", "ProcessesEnded")]
    assert _witness(seen, {}).wrong_marks({"u-old": "ProcessesRunning"}, set()) == []
