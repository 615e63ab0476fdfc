"""A clock the unit suites move by hand: the code under test reads ``clock()``, the test
advances ``clock.now``."""


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
