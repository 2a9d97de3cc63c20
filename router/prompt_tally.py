"""Prompt tokens and their attention work, as the router's view tallies them per replica
between heartbeats (`router/cluster_view.py`): what this router sent a replica since its
last heartbeat and what got its first token since, and what the heartbeat says is
computed already of the prompts still waiting there; from those and what the replica
computed since the heartbeat was taken, what is still to compute (`pending`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Tally:
    tokens: int = 0
    work: int = 0

    def add(self, tokens: int, work: int) -> None:
        self.tokens += tokens
        self.work += work


@dataclass
class Since:
    """This router's prompts on one replica since its last heartbeat: those it sent, and
    those that got their first token; and, where it sent one while nothing was left to
    compute there, when (`woke_at`) and what it had sent before it (`sent_before`): the
    replica has computed the prompts sent from then on since."""

    sent: Tally = field(default_factory=Tally)
    done: Tally = field(default_factory=Tally)
    woke_at: float | None = None
    sent_before: Tally = field(default_factory=Tally)

    def wake(self, at: float) -> None:
        self.woke_at = at
        self.sent_before = Tally(self.sent.tokens, self.sent.work)


@dataclass
class Computed:
    """What is computed already of this router's prompts still waiting on one replica,
    and of those its background prefills' share."""

    all: Tally = field(default_factory=Tally)
    background: Tally = field(default_factory=Tally)

    def add(self, tokens: int, work: int, background: bool) -> None:
        self.all.add(tokens, work)
        if background:
            self.background.add(tokens, work)


def pending(reported: float, own_left: float, ran: float, sent: float = 0.0, done: float = 0.0) -> int:
    """Prompt tokens (or their work) still to compute on a replica: what its heartbeat
    reported plus what this router sent since, less what the replica computed since (`ran`,
    at least what got its first token, `done`); never less than this router's own prompts
    still waiting there (`own_left`, less their progress the heartbeat reported) less what
    of them the replica computed since."""
    return max(0, round(max(own_left - max(0.0, ran - done), reported + sent - max(ran, done))))
