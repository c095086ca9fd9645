"""Where a worker's next claim resumes (docs/explanation/claims.md, "Resuming where the last claims
stopped"): the last row it claimed in each priority level, and for a fair queue in each of the keys
it claimed from lately, so that beside an old snapshot a claim does not step over every row claimed
since that snapshot began. Kept only while claims come back full (a backlog is being drained): after
a short one, and at least every RESCAN_INTERVAL, the next claim scans from the start. Rows become
READY behind the positions all the time where a queue keeps up (a keyed task admitted when a slot
frees keeps its place): resumed claims would pass them over until the next scan from the start (a
keyed drain fell from 2,100 to 150 tasks/s)."""

from __future__ import annotations

from tasks.lifecycle.values import ClaimedTask, ClaimPosition, FairPositions

# Seconds between claims that scan each level from its front (the rest resume where the last claims
# stopped): how long a READY row behind those positions (a hand-back keeping its place) may wait, and
# how often a claim pays for the dead entries an old snapshot keeps (one pass over them per interval).
RESCAN_INTERVAL = 1.0
# Positions in a fair queue's keys a worker keeps, per row of its batch size (a claim visits at most
# its limit of keys, so four claims' worth: a few hundred, each claim sending them all).
FAIR_POSITIONS_PER_BATCH = 4


class ClaimPositions:
    """A dispatcher's positions: :meth:`resumes` says whether a claim sent at a time resumes,
    :meth:`after` and :meth:`fair_after` what it sends, :meth:`claimed` what it came back with."""

    def __init__(self, batch_size: int) -> None:
        self.levels: dict[tuple[str, int], ClaimPosition] = {}
        # The same in a fair queue's keys: where its last claims stopped in each key (and level) they
        # took rows from, so that a key's next turn resumes there (tasks/lifecycle/claim.py, ``mine``);
        # the most recent few only (FairPositions).
        self.keys = FairPositions(FAIR_POSITIONS_PER_BATCH * batch_size)
        self.scan_from_start_at = 0.0
        self.full = False  # the last claim came back full
        self.resumed_short = False  # the last claim resumed and came back short: look again at once

    def resumes(self, sent: float) -> bool:
        return self.full and sent < self.scan_from_start_at

    def after(self, resume: bool) -> list[ClaimPosition]:
        return list(self.levels.values()) if resume else []

    def fair_after(self, resume: bool, fair: bool) -> FairPositions | tuple[()]:
        # (a worker that goes round more keys than it keeps positions in would send them for nothing)
        return self.keys if resume and fair and self.keys.revisits else ()

    def claimed(self, claimed: list[ClaimedTask], claim: int, sent: float, *, resumed: bool, fair: bool) -> None:
        """Where this claim stopped in each level it took rows from. A scan from the start replaces
        every position (a level it found empty has none now) and sets when the next one is due."""
        if not resumed:
            self.levels = {}
            self.keys.clear()
            self.scan_from_start_at = sent + RESCAN_INTERVAL
        self.levels.update(ClaimPosition.last_per_level(claimed))
        if fair:
            self.keys.remember(claimed)
        self.full = len(claimed) == claim
        self.resumed_short = resumed and len(claimed) < claim
