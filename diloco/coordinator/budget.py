"""The run's token budget (``diloco server --token-budget N``, SPEC.md section 12, "Token budget").

Counts the tokens the applied contributions trained on (``Submit.tokens``; a
contribution that does not say counts 0) and says when they reach the budget,
whereupon the coordinator stops the run as ``shutdown --save`` does. What an
applied round trained on is durable with it: the count is part of every
checkpoint and journal commit. The rate behind the ETA is this incarnation's
own (tokens per second since its first applied round), so a restart does not
average in the time it was down.
"""

from __future__ import annotations

import math


class TokenBudget:
    def __init__(self, budget: int | None = None, trained: int = 0) -> None:
        self.budget = check_budget(budget)
        self.trained = trained
        self._first: tuple[float, int] | None = None  # (time, trained) at this incarnation's first count
        self._last_s = 0.0

    def add(self, tokens: int, now_s: float) -> None:
        self.trained += tokens
        self._last_s = now_s
        if self._first is None:  # the rate counts what was trained after this round, not before it
            self._first = (now_s, self.trained)

    @property
    def reached(self) -> bool:
        return self.budget is not None and self.trained >= self.budget

    def rate(self) -> float | None:
        """Tokens per second since this incarnation's first applied round (None before a second one)."""
        if self._first is None or self._last_s <= self._first[0]:
            return None
        return (self.trained - self._first[1]) / (self._last_s - self._first[0])

    def status(self) -> dict:
        rate = self.rate()
        left = None if self.budget is None else max(0, self.budget - self.trained)
        eta = None if left is None or not rate else left / rate
        return {"trained": self.trained, "budget": self.budget, "left": left,
                "fraction": None if self.budget is None else min(1.0, self.trained / self.budget),
                "tokens_per_s": None if rate is None else round(rate, 3),
                "eta_s": None if eta is None or not math.isfinite(eta) else round(eta, 1)}

    def to_dict(self) -> dict:
        return {"budget": self.budget, "trained": self.trained}

    @classmethod
    def from_dict(cls, d: dict | None) -> TokenBudget:
        d = d or {}
        trained = d.get("trained", 0)
        if isinstance(trained, bool) or not isinstance(trained, int) or trained < 0:
            raise ValueError(f"token budget: trained={trained!r} is not a count of tokens")
        return cls(d.get("budget"), trained)


def check_budget(budget: object) -> int | None:
    """``budget`` if it is None (no budget) or an integer >= 1; ``ValueError`` naming what it got otherwise."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"token budget {budget!r} is invalid: expected an integer >= 1 (tokens), or none")
    return budget
