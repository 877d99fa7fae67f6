//! Turns: the claim attempts each StorageClass may have in flight, always fewer than the reconcile
//! workers and than its guest's slots (and no more than the class's own annotation,
//! [`super::plan::ANN_MAX_IN_FLIGHT`]); over that, a claim is parked in its class's queue and
//! woken in arrival order.
//!
//! Why: once every worker is busy, kube-runtime's runner moves each due object into a set it
//! serves in hash order, not in time order (`Scheduler::hold`). A burst of thousands of claims of
//! one class (new ones, or retries of a guest that keeps failing) would keep every worker busy for
//! as long as it lasts, and a claim of another class whose place in that order is late waited
//! that long: its PV was created 65.3 s after it behind 5,000 first attempts, and > 60 s behind
//! 5,000 retries. Parked, a claim costs nothing (no request, guest call or requeue) and leaves
//! kube-runtime's queue, which then holds only new work and the woken. Any one class leaves a
//! worker and a guest slot over for the others (with more turns than its guest's slots, the
//! claims over them would find the guest busy and go back to kube-runtime's queue on a timer
//! instead of parking), and every class gets its own turns, so one class's burst never waits
//! behind another's. Several classes bursting at once can still fill every worker between them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::reflector::ObjectRef;

use super::plan::class_limit;

type ClaimRef = ObjectRef<PersistentVolumeClaim>;

/// Claim attempts in flight per class, and the claims parked for a turn.
#[derive(Debug)]
pub struct Turns {
    classes: Mutex<HashMap<String, ClassTurns>>,
    /// One less than the workers (at least one): the most any class may hold.
    ceiling: usize,
    wake: UnboundedSender<ClaimRef>,
    wakeups: Mutex<Option<UnboundedReceiver<ClaimRef>>>,
}

/// One class's attempts in flight and its queue.
#[derive(Debug, Default)]
struct ClassTurns {
    running: usize,
    /// The class's limit as last seen (its annotation can change).
    limit: usize,
    /// Parked claims, longest parked first; `is_parked` says which entries still are (a claim
    /// forgotten by a refresh leaves its entry behind).
    parked: VecDeque<ClaimRef>,
    is_parked: HashSet<ClaimRef>,
    /// Claims woken for a freed turn and not back yet, with when: the turn is kept for them.
    woken: HashMap<ClaimRef, Instant>,
}

impl ClassTurns {
    /// Turns neither taken nor kept for a woken claim.
    fn free(&self) -> bool {
        self.running + self.woken.len() < self.limit
    }

    /// Nothing in flight, parked or woken: the class's entry can go.
    fn is_idle(&self) -> bool {
        self.running == 0 && self.is_parked.is_empty() && self.woken.is_empty()
    }
}

/// One attempt's turn, given back when dropped (waking the class's longest parked claim).
#[derive(Debug)]
pub struct Turn<'a> {
    turns: &'a Turns,
    class: String,
}

impl Turns {
    /// Turns for a controller with `workers` reconcile workers.
    pub fn new(workers: u16) -> Turns {
        let (wake, wakeups) = unbounded();
        Turns {
            classes: Mutex::default(),
            ceiling: usize::from(workers).saturating_sub(1).max(1),
            wake,
            wakeups: Mutex::new(Some(wakeups)),
        }
    }

    /// How many attempts of `class` may be in flight at once, its guest having `guest_slots`
    /// calls at once: one less than the workers and one less than the guest's slots (each at
    /// least one), and no more than the class's annotation.
    pub fn limit(&self, class: &StorageClass, guest_slots: usize) -> usize {
        let limit = self.ceiling.min(guest_slots.saturating_sub(1).max(1));
        class_limit(class).map_or(limit, |annotated| annotated.min(limit))
    }

    /// Takes a turn for `claim` of `class`, or parks it (once) to be woken through
    /// [`Turns::wakeups`] when a turn is its.
    ///
    /// First come, first served: a claim that comes on its own (a retry come due, a change)
    /// neither takes the turn kept for a woken claim nor passes the claims parked before it.
    /// Otherwise retries coming due, each taking the turn freed a moment before, kept the claims
    /// parked longest waiting for minutes.
    pub fn acquire_or_park(
        &self,
        class: &StorageClass,
        guest_slots: usize,
        claim: ClaimRef,
    ) -> Option<Turn<'_>> {
        let name = class.metadata.name.clone().unwrap_or_default();
        let limit = self.limit(class, guest_slots);
        // One lock for the count and the queue: a turn freed between a refusal and the parking
        // would otherwise find nobody to wake.
        let mut classes = self.classes.lock().expect("lock");
        let turns = classes.entry(name.clone()).or_default();
        turns.limit = limit;
        let was_woken = turns.woken.remove(&claim).is_some();
        if turns.free() && (was_woken || turns.is_parked.is_empty()) {
            turns.running += 1;
            return Some(Turn {
                turns: self,
                class: name,
            });
        }
        if turns.is_parked.insert(claim.clone()) {
            if was_woken {
                turns.parked.push_front(claim);
            } else {
                turns.parked.push_back(claim);
            }
        }
        self.fill(turns);
        None
    }

    /// Lets go of whatever `claim` of `class` holds in the queue (its place, or the turn kept
    /// for it): it needs no turn now (bound, deleted, not ours), and the next one gets it at once.
    pub fn pass(&self, class: &str, claim: &ClaimRef) {
        let mut classes = self.classes.lock().expect("lock");
        let Some(turns) = classes.get_mut(class) else {
            return;
        };
        let woken = turns.woken.remove(claim).is_some();
        if woken || turns.is_parked.remove(claim) {
            self.fill(turns);
        }
    }

    /// The parked claims to reconcile, one each time a turn is theirs; for the claim
    /// controller's `reconcile_on`. Empty after the first call.
    pub fn wakeups(&self) -> UnboundedReceiver<ClaimRef> {
        self.wakeups
            .lock()
            .expect("lock")
            .take()
            .unwrap_or_else(|| unbounded().1)
    }

    /// Forgets claims that `belongs` says are no longer of the class they wait in (deleted, not
    /// ours, or of another class now), and wakes parked claims for the turns that frees. A
    /// claim woken longer than `kept` ago and not back (its reconcile waits behind others in
    /// kube-runtime's queue) goes back to the front and is woken again. Run every few seconds,
    /// this bounds how long a turn can stay kept for a claim that will never take it.
    pub fn refresh(&self, belongs: impl Fn(&str, &ClaimRef) -> bool, kept: Duration) {
        let mut classes = self.classes.lock().expect("lock");
        for (class, turns) in classes.iter_mut() {
            let still = |claim: &ClaimRef| belongs(class, claim);
            turns.is_parked.retain(|claim| still(claim));
            turns.woken.retain(|claim, _| still(claim));
            let mut late: Vec<_> = turns
                .woken
                .iter()
                .filter(|(_, at)| at.elapsed() >= kept)
                .map(|(claim, at)| (*at, claim.clone()))
                .collect();
            // Pushed to the front latest first, so the one woken longest ago leads.
            late.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
            for (_, claim) in late {
                turns.woken.remove(&claim);
                turns.is_parked.insert(claim.clone());
                turns.parked.push_front(claim);
            }
            let ClassTurns {
                parked, is_parked, ..
            } = turns;
            let mut seen = HashSet::new();
            parked.retain(|claim| is_parked.contains(claim) && seen.insert(claim.clone()));
            self.fill(turns);
        }
        classes.retain(|_, turns| !turns.is_idle());
    }

    /// Wakes parked claims, longest parked first, for every turn of the class that is free.
    fn fill(&self, turns: &mut ClassTurns) {
        while turns.free() && self.wake_next(turns) {}
    }

    /// Wakes the longest parked claim of a class, keeping a turn for it; false when none is
    /// parked.
    fn wake_next(&self, turns: &mut ClassTurns) -> bool {
        while let Some(claim) = turns.parked.pop_front() {
            if turns.is_parked.remove(&claim) {
                turns.woken.insert(claim.clone(), Instant::now());
                // The receiver is gone only at shutdown.
                let _ = self.wake.unbounded_send(claim);
                return true;
            }
        }
        false
    }

    /// Attempts of `class` in flight.
    pub fn running(&self, class: &str) -> usize {
        let classes = self.classes.lock().expect("lock");
        classes.get(class).map_or(0, |turns| turns.running)
    }

    /// Claims parked, over every class.
    pub fn parked(&self) -> usize {
        let classes = self.classes.lock().expect("lock");
        classes.values().map(|turns| turns.is_parked.len()).sum()
    }

    /// Classes with attempts in flight or claims parked or woken.
    pub fn classes(&self) -> usize {
        self.classes.lock().expect("lock").len()
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut classes = self.turns.classes.lock().expect("lock");
        let Some(turns) = classes.get_mut(&self.class) else {
            return;
        };
        turns.running -= 1;
        self.turns.fill(turns);
        if turns.is_idle() {
            classes.remove(&self.class);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::plan::ANN_MAX_IN_FLIGHT;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn class(name: &str, limit: Option<&str>) -> StorageClass {
        StorageClass {
            metadata: ObjectMeta {
                name: Some(name.into()),
                annotations: limit.map(|l| [(ANN_MAX_IN_FLIGHT.to_string(), l.to_string())].into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// A guest with slots to spare: the workers decide.
    const SLOTS: usize = 64;

    fn claim(name: &str) -> ClaimRef {
        ObjectRef::new(name).within("ns")
    }

    /// A turn for `name`, which must get one.
    fn take<'a>(turns: &'a Turns, class: &StorageClass, name: &str) -> Turn<'a> {
        turns
            .acquire_or_park(class, SLOTS, claim(name))
            .expect("a turn")
    }

    /// Parks each of `names`, which must find no turn.
    fn park(turns: &Turns, class: &StorageClass, names: &[&str]) {
        for name in names {
            assert!(
                turns.acquire_or_park(class, SLOTS, claim(name)).is_none(),
                "{name} parked"
            );
        }
    }

    /// One turn for class `crowd`: `a` and `b` parked behind it, then `a` woken for it.
    fn a_woken_and_b_parked() -> (Turns, UnboundedReceiver<ClaimRef>) {
        let turns = Turns::new(2);
        let mut wakeups = turns.wakeups();
        let crowd = class("crowd", None);
        let held = take(&turns, &crowd, "held");
        park(&turns, &crowd, &["a", "b"]);
        drop(held);
        assert_eq!(wakeups.try_recv().ok(), Some(claim("a")));
        (turns, wakeups)
    }

    #[test]
    fn each_class_leaves_a_worker_over_and_parks_in_order() {
        use futures::StreamExt;
        let turns = Turns::new(4);
        let mut wakeups = turns.wakeups();
        let crowd = class("crowd", None);
        let mut held: Vec<_> = (0..3)
            .map(|n| {
                turns
                    .acquire_or_park(&crowd, SLOTS, claim(&format!("held-{n}")))
                    .expect("turn")
            })
            .collect();
        assert!(
            turns.acquire_or_park(&crowd, SLOTS, claim("a")).is_none(),
            "the fourth worker stays free"
        );
        assert!(turns.acquire_or_park(&crowd, SLOTS, claim("b")).is_none());
        assert!(
            turns.acquire_or_park(&crowd, SLOTS, claim("a")).is_none(),
            "parked once"
        );
        assert!(
            turns
                .acquire_or_park(&crowd, SLOTS, claim("gone"))
                .is_none()
        );
        assert_eq!((turns.running("crowd"), turns.parked()), (3, 3));
        let other = turns
            .acquire_or_park(&class("other", None), SLOTS, claim("other"))
            .expect("another class has turns of its own");
        drop(other);
        turns.refresh(|_, c| c.name != "gone", Duration::ZERO);
        assert_eq!(turns.parked(), 2, "no turn free: nobody woken");
        held.clear();
        assert_eq!(turns.running("crowd"), 0);
        let woken: Vec<_> = futures::executor::block_on(wakeups.by_ref().take(2).collect());
        assert_eq!(woken, [claim("a"), claim("b")], "longest parked first");
        assert_eq!(turns.parked(), 0);
        assert!(
            wakeups.try_recv().is_err(),
            "the third free turn found nobody parked"
        );
        assert_eq!(
            Turns::new(1).limit(&crowd, SLOTS),
            1,
            "a single worker still works"
        );
        assert_eq!(Turns::new(0).limit(&crowd, SLOTS), 1);
    }

    #[test]
    fn a_class_annotation_caps_its_own_claims_below_the_workers() {
        let turns = Turns::new(16);
        assert_eq!(turns.limit(&class("quiet", None), SLOTS), 15);
        assert_eq!(turns.limit(&class("huge", Some("100")), SLOTS), 15);
        assert_eq!(turns.limit(&class("junk", Some("x")), SLOTS), 15);
        assert_eq!(
            turns.limit(&class("quiet", None), 4),
            3,
            "never its guest's last slot"
        );
        assert_eq!(turns.limit(&class("quiet", None), 1), 1);
        let storm = class("storm", Some("2"));
        let a = take(&turns, &storm, "a");
        let b = take(&turns, &storm, "b");
        assert!(
            turns.acquire_or_park(&storm, SLOTS, claim("c")).is_none(),
            "third of 2"
        );
        let quiet: Vec<_> = (0..10)
            .map(|n| turns.acquire_or_park(&class("quiet", None), SLOTS, claim(&format!("q{n}"))))
            .collect();
        assert!(
            quiet.iter().all(Option::is_some),
            "other classes are not held up"
        );
        drop(quiet);
        drop((a, b));
        let c = take(&turns, &storm, "c");
        drop(c);
        assert_eq!(
            turns.classes(),
            0,
            "a class with nothing in flight is forgotten"
        );
    }

    #[test]
    fn a_freed_turn_is_kept_for_the_claim_woken_for_it() {
        let (turns, mut wakeups) = a_woken_and_b_parked();
        let crowd = class("crowd", None);
        // A retry come due before `a` is back neither takes its turn nor passes `b`.
        assert!(
            turns
                .acquire_or_park(&crowd, SLOTS, claim("retry"))
                .is_none()
        );
        let a = take(&turns, &crowd, "a");
        drop(a);
        assert_eq!(wakeups.try_recv().ok(), Some(claim("b")));
        let b = take(&turns, &crowd, "b");
        drop(b);
        assert_eq!(
            wakeups.try_recv().ok(),
            Some(claim("retry")),
            "then the retry"
        );
    }

    #[test]
    fn a_woken_claim_that_finds_no_turn_keeps_its_place() {
        let turns = Turns::new(4);
        let mut wakeups = turns.wakeups();
        let storm = class("storm", Some("2"));
        let first = take(&turns, &storm, "first");
        let second = take(&turns, &storm, "second");
        park(&turns, &storm, &["a", "b"]);
        drop(first);
        assert_eq!(wakeups.try_recv().ok(), Some(claim("a")));
        // The class's limit was lowered before `a` came back: no turn, but `a` stays ahead of b.
        let lowered = class("storm", Some("1"));
        assert!(turns.acquire_or_park(&lowered, SLOTS, claim("a")).is_none());
        drop(second);
        assert_eq!(wakeups.try_recv().ok(), Some(claim("a")), "a first");
    }

    #[test]
    fn a_claim_that_needs_no_turn_passes_it_on_at_once() {
        let turns = Turns::new(2);
        let mut wakeups = turns.wakeups();
        let crowd = class("crowd", None);
        let held = take(&turns, &crowd, "held");
        park(&turns, &crowd, &["a", "b", "c"]);
        // `b` was bound by another replica while parked: it leaves the queue.
        turns.pass("crowd", &claim("b"));
        drop(held);
        assert_eq!(wakeups.try_recv().ok(), Some(claim("a")));
        // `a` came back to find its PV made: its kept turn goes to `c`, not after a refresh.
        turns.pass("crowd", &claim("a"));
        assert_eq!(wakeups.try_recv().ok(), Some(claim("c")));
        assert!(wakeups.try_recv().is_err());
        turns.pass("nobody", &claim("x"));
    }

    #[test]
    fn a_refresh_wakes_parked_claims_for_turns_nobody_came_back_for() {
        let (turns, mut wakeups) = a_woken_and_b_parked();
        turns.refresh(|_, _| true, Duration::from_secs(60));
        assert!(wakeups.try_recv().is_err(), "a's turn is still kept for it");
        // `a` was deleted meanwhile and never comes back: `b` waits though no turn is taken.
        assert_eq!((turns.running("crowd"), turns.parked()), (0, 1));
        turns.refresh(|_, c| c.name != "a", Duration::from_secs(60));
        assert_eq!(wakeups.try_recv().ok(), Some(claim("b")));
        assert_eq!(turns.parked(), 0);
        // Nor will `b`: it is of another class now. Nothing is left of the class.
        turns.refresh(|class, _| class != "crowd", Duration::from_secs(60));
        assert!(wakeups.try_recv().is_err());
        assert_eq!(turns.classes(), 0);
    }

    #[test]
    fn a_woken_claim_slow_to_come_back_is_woken_again_in_its_place() {
        let (turns, mut wakeups) = a_woken_and_b_parked();
        let crowd = class("crowd", None);
        // `a`'s reconcile waits behind others in kube-runtime's queue past the time kept.
        turns.refresh(|_, _| true, Duration::ZERO);
        assert_eq!(wakeups.try_recv().ok(), Some(claim("a")), "woken again");
        assert!(wakeups.try_recv().is_err(), "b still waits behind it");
        let a = take(&turns, &crowd, "a");
        drop(a);
        assert_eq!(wakeups.try_recv().ok(), Some(claim("b")));
    }
}
