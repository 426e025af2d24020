"""Straggler detection on its own (`health.stragglers`): who is slow against the median, for how many windows in
a row, and the one line per episode."""

from __future__ import annotations

import pytest

from gaudi3_scale.health.stragglers import Straggler, StragglerDetector


def _detector(lines: list[str], *, threshold: float = 0.2, windows: int = 3) -> StragglerDetector:
    return StragglerDetector(threshold=threshold, windows=windows, warn=lines.append)


def test_a_rank_slow_for_the_given_windows_in_a_row_is_named_once() -> None:
    lines: list[str] = []
    detector = _detector(lines)
    named = [detector.observe(10 * (w + 1), [0.010, 0.030, 0.011, 0.010]) for w in range(5)]
    assert named == [[], [], [1], [1], [1]]  # named at the third slow window, and while it stays slow
    (episode,) = detector.episodes
    # median of (0.010, 0.010, 0.011, 0.030) = 0.0105
    assert episode == Straggler(rank=1, step=30, ratio=pytest.approx(0.030 / 0.0105), windows=3)
    assert lines == ["health: rank 1 is a straggler: its own compute per step is 2.9× the median for 3 windows "
                     "(step 30)"]  # fmt: skip


def test_a_fast_window_ends_the_streak_and_a_new_episode_warns_again() -> None:
    lines: list[str] = []
    detector = _detector(lines, windows=2)
    slow, even = [0.01, 0.05], [0.01, 0.0105]
    assert [detector.observe(s, t) for s, t in enumerate([slow, even, slow, slow, even, slow, slow])] == [
        [], [], [], [1], [], [], [1]
    ]  # fmt: skip
    assert [e.step for e in detector.episodes] == [3, 6] and len(lines) == 2


def test_no_rank_is_named_within_the_threshold_or_alone() -> None:
    lines: list[str] = []
    detector = _detector(lines, threshold=0.2)
    for step in range(10):
        # 2 ranks: the median is their mean, so 1.4× the other rank is 1.17× the median, under 1.2
        assert detector.observe(step, [0.010, 0.014]) == []
        assert detector.observe(step, [0.5]) == []
        assert detector.observe(step, [0.0, 0.0]) == []  # nothing measured: no median to be slow against
    assert not lines and not detector.episodes


def test_two_ranks_at_1_6x_the_other_are_named() -> None:
    detector = _detector([], threshold=0.2, windows=1)
    assert detector.observe(1, [0.016, 0.010]) == [0]
