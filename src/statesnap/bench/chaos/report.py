"""Counting what the chaos trials did: each scenario's trials, outcomes and details.

Every trial ends in one of three outcomes: ``expected`` (the library did what it promises),
``wrong`` (anything else: a silent wrong value, a partial checkpoint in view, an error that is
not a ``CheckpointError``, a crash) or ``hang`` (the trial ran past its deadline and was
killed). Details are labels counted alongside (where a kill landed, how a damage was caught,
which disk-full method ran), so the report says what the trials covered, not only that they
passed. A few messages of unexpected outcomes are kept to show what went wrong.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .processes import Child

EXPECTED, WRONG, HANG = "expected", "wrong", "hang"
OUTCOMES = (EXPECTED, WRONG, HANG)
KEPT_MESSAGES = 5


def verdict(problems: list[str], details=()) -> dict:
    """A trial's result as its child returns it: expected if no problem was found."""
    return {"outcome": WRONG if problems else EXPECTED, "details": list(details), "message": "; ".join(problems)}


def judge(result: dict | None, status: int | None, child: Child, timeout: float) -> tuple[str, list, str]:
    """(outcome, details, message) of a trial run in a child: its own verdict, or a hang or crash."""
    if status is None:
        return HANG, [], f"ran past {timeout:g} s and was killed: {child.log_text(1500)}"
    if result is None:
        return WRONG, [], f"exited with {status} and no result: {child.log_text(1500)}"
    return result["outcome"], list(result.get("details", ())), result.get("message", "")


@dataclass
class Tally:
    scenario: str
    trials: int = 0
    outcomes: Counter = field(default_factory=Counter)
    details: Counter = field(default_factory=Counter)
    messages: list[str] = field(default_factory=list)

    def add(self, outcome: str, details=(), message: str = "") -> None:
        self.trials += 1
        self.outcomes[outcome] += 1
        self.details.update(details)
        if outcome != EXPECTED and len(self.messages) < KEPT_MESSAGES:
            self.messages.append(message or "(no message)")

    def add_run(self, run: tuple[dict | None, int | None, Child], timeout: float) -> str:
        """Count a trial run by the fork server (``ForkServer.run``); return its outcome."""
        outcome, details, message = judge(*run, timeout)
        self.add(outcome, details, message)
        return outcome

    @property
    def unexpected(self) -> int:
        return self.outcomes[WRONG] + self.outcomes[HANG]

    def to_json(self) -> dict:
        return {"scenario": self.scenario, "trials": self.trials,
                **{name: self.outcomes[name] for name in OUTCOMES},
                "details": dict(sorted(self.details.items())), "messages": self.messages}
