//! Handing out revisions: from a fresh reservation, or from one this
//! controller made earlier and has not used up.
//!
//! A reservation is a status write that raises `status.schedRev`,
//! conditional on the resourceVersion the plan was made from (SPEC 4.1).
//! When it reserves only what one plan issues, every wave of a rollout
//! costs a status write before its creates. Reserving *ahead* — also a
//! revision for each node still waiting its turn — lets the later waves
//! issue from the range the first write reserved, with no write of their
//! own. Only the writer that raised `schedRev` to the range's top knows
//! which of it is unused, so only it may issue from it, and only while no
//! one has raised `schedRev` since (a higher one means another writer
//! reserved above, and a revision from below it would be older than that
//! writer's attempts). Anyone else starts above `schedRev`; a range left
//! unused by a restart or a change of leader is skipped, never reissued.

/// Revisions `(issued, reserved]` that this controller reserved with its
/// own status write and has not issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OwnReservation {
    /// The newest revision issued from it.
    pub issued: i64,
    /// `status.schedRev` as that write left it.
    pub reserved: i64,
}

impl OwnReservation {
    /// Whether revisions may still be issued from it, given the status's
    /// `schedRev` and the newest revision among the attempts.
    pub fn usable(&self, sched_rev: i64, newest_attempt: i64) -> bool {
        self.reserved == sched_rev && newest_attempt <= self.issued && self.issued < self.reserved
    }
}

/// How a plan hands out revisions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Revisions {
    /// What this controller reserved earlier and has not issued, if it knows.
    pub own: Option<OwnReservation>,
    /// Whether a reservation also covers every node still waiting its turn
    /// in the rollout. Off where nothing else can write the status
    /// (standalone mode), so revisions stay dense.
    pub ahead: bool,
}

/// Where a plan's revisions come from and what it leaves reserved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Issuer {
    next: i64,
    reserved: i64,
    ahead: bool,
}

impl Issuer {
    /// Starts above `own`'s issued revisions when it is usable, else above
    /// every revision the status or an attempt shows.
    pub(super) fn new(revisions: Revisions, sched_rev: i64, newest_attempt: i64) -> Issuer {
        let floor = sched_rev.max(newest_attempt);
        match revisions
            .own
            .filter(|own| own.usable(sched_rev, newest_attempt))
        {
            Some(own) => Issuer {
                next: own.issued,
                reserved: own.reserved,
                ahead: revisions.ahead,
            },
            None => Issuer {
                next: floor,
                reserved: floor,
                ahead: revisions.ahead,
            },
        }
    }

    /// The next revision.
    pub(super) fn issue(&mut self) -> i64 {
        self.next += 1;
        self.next
    }

    /// The `schedRev` to write, with `waiting` nodes still to be issued an
    /// attempt in this rollout: unchanged while the issued revisions fit the
    /// reservation in hand, else a new reservation (ahead by `waiting`).
    pub(super) fn sched_rev(&self, waiting: usize) -> i64 {
        if self.next <= self.reserved {
            return self.reserved;
        }
        let ahead = if self.ahead {
            i64::try_from(waiting).unwrap_or(0)
        } else {
            0
        };
        self.next.saturating_add(ahead)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own(issued: i64, reserved: i64) -> Option<OwnReservation> {
        Some(OwnReservation { issued, reserved })
    }

    #[test]
    fn without_a_reservation_in_hand_revisions_start_above_everything_seen() {
        let mut issuer = Issuer::new(Revisions::default(), 4, 6);
        assert_eq!(issuer.issue(), 7);
        assert_eq!(issuer.sched_rev(5), 7, "not ahead: exactly what was issued");
    }

    #[test]
    fn ahead_a_reservation_covers_the_nodes_still_waiting() {
        let revisions = Revisions {
            own: None,
            ahead: true,
        };
        let mut issuer = Issuer::new(revisions, 0, 0);
        assert_eq!(issuer.issue(), 1);
        assert_eq!(issuer.sched_rev(2), 3);
    }

    #[test]
    fn an_own_reservation_is_used_before_a_new_one_and_needs_no_write() {
        let revisions = Revisions {
            own: own(1, 3),
            ahead: true,
        };
        let mut issuer = Issuer::new(revisions, 3, 1);
        assert_eq!((issuer.issue(), issuer.issue()), (2, 3));
        assert_eq!(issuer.sched_rev(0), 3, "within the reservation: unchanged");
        assert_eq!(issuer.issue(), 4);
        assert_eq!(issuer.sched_rev(1), 5, "past it: a new reservation");
    }

    #[test]
    fn an_own_reservation_another_writer_raised_past_is_not_used() {
        let revisions = Revisions {
            own: own(1, 3),
            ahead: true,
        };
        // schedRev 5: someone reserved above; revision 2 would be older than theirs.
        let mut issuer = Issuer::new(revisions, 5, 4);
        assert_eq!(issuer.issue(), 6);
        // An attempt newer than what it issued: the cache knows more than the memory.
        let mut issuer = Issuer::new(revisions, 3, 2);
        assert_eq!(issuer.issue(), 4);
        // Used up.
        let spent = Revisions {
            own: own(3, 3),
            ahead: true,
        };
        assert_eq!(Issuer::new(spent, 3, 3).issue(), 4);
    }
}
