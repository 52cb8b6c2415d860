"""``--grace-window auto``: each async window as long as the recent arrivals say (SPEC.md P5).

Sans-IO: the times come in as arguments. The hub's half tells it when a fragment's window opens
(its first contribution is held), each later arrival in it, and when it closes; after each close
it proposes the next window's length:

    median + K * MAD of the recent arrival offsets (an arrival's time after its window opened),

within ``[FLOOR_S, ceiling]`` (``--grace-window-max``). The median and the median absolute
deviation ignore a worker far slower than the rest: the window covers the spread of the ordinary
ones, not the straggler's. A window that closed on its deadline with live members still out never
saw them arrive: the next window's opener counts with its offset from that closed window's opening
(when it is within the ceiling), so a window too short for the workers it should merge grows back.
A change under ``HYSTERESIS`` of the current length is not proposed: the core hears of a new
length only when it matters.
"""

from __future__ import annotations

import collections

#: The deviation's multiple above the median (3 MADs: about 2 standard deviations of a normal spread).
K = 3.0
#: Offsets the estimate keeps (the most recent).
RECENT = 64
#: Offsets needed before the first proposal: until then the window is the ceiling.
MIN_SAMPLES = 4
#: The shortest window proposed, s.
FLOOR_S = 0.05
#: Relative change below which the current length stays.
HYSTERESIS = 0.05


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


class AutoGraceWindow:
    def __init__(self, ceiling_s: float, start_s: float | None = None) -> None:
        self.ceiling_s = ceiling_s
        #: The length in force (the core's): the ceiling on a fresh run, a resumed core's own length.
        self.window_s = ceiling_s if start_s is None else start_s
        self._offsets: collections.deque[float] = collections.deque(maxlen=RECENT)
        #: fragment -> when its open window opened.
        self._opened: dict[int, float] = {}
        #: fragment -> when its last window opened, if that one closed with live members still out.
        self._censored: dict[int, float] = {}

    def accepted(self, fragment_id: int, now_s: float) -> None:
        """A contribution was held: it opens the fragment's window, or arrived in the open one."""
        opened = self._opened.get(fragment_id)
        if opened is not None:
            self._offsets.append(now_s - opened)
            return
        self._opened[fragment_id] = now_s
        late_for = self._censored.pop(fragment_id, None)
        if late_for is not None and now_s - late_for <= self.ceiling_s:
            self._offsets.append(now_s - late_for)

    def closed(self, fragment_id: int, everyone_in: bool) -> float | None:
        """The fragment's window closed (``everyone_in``: every live member had a contribution in it).
        The next window's length when it should change, else None."""
        opened = self._opened.pop(fragment_id, None)
        if opened is not None and not everyone_in:
            self._censored[fragment_id] = opened
        if len(self._offsets) < MIN_SAMPLES:
            return None
        xs = list(self._offsets)
        median = _median(xs)
        mad = _median([abs(x - median) for x in xs])
        proposed = min(self.ceiling_s, max(FLOOR_S, median + K * mad))
        if abs(proposed - self.window_s) <= HYSTERESIS * self.window_s:
            return None
        self.window_s = proposed
        return proposed

    def status(self) -> dict:
        return {"auto": True, "window_s": round(self.window_s, 6), "ceiling_s": self.ceiling_s,
                "samples": len(self._offsets)}
