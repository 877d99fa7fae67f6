//! Turns: the claim attempts that may be in flight at once, always fewer than the reconcile
//! workers over every class together, fewer than each guest's slots over every class it serves,
//! and no more than a class's own annotation ([`super::plan::ANN_MAX_IN_FLIGHT`]); over that, a
//! claim is parked in its class's queue, and freed turns go round the classes with claims parked.
//!
//! Why: once every worker is busy, kube-runtime's runner moves each due object into a set it
//! serves in hash order, not in time order (`Scheduler::hold`). A burst of thousands of claims
//! (new ones, or retries of a guest that keeps failing) that kept every worker busy held a claim
//! whose place in that order is late for as long as it lasted: another class's claim had its PV
//! 65.3 s after it behind one class's 5,000 first attempts; with a limit per class and none
//! shared, two classes of 2,500 held every worker between them, and 158 of their own claims were
//! not attempted once within 300 s. Parked, a claim costs nothing (no request, guest call or
//! requeue) and leaves kube-runtime's queue, which then holds only new work and the woken, and
//! a worker is always left for it. Freed turns go round the classes, so a class with one claim
//! waits behind at most one claim of each other class, never behind a crowd; within a class,
//! first come, first served. A guest's last slot is never a claim's: deletes find it free, and
//! claims over the guest's turns park instead of finding it busy and going back to
//! kube-runtime's queue on a timer.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::reflector::ObjectRef;

use super::plan::class_limit;

type ClaimRef = ObjectRef<PersistentVolumeClaim>;

/// Claim attempts in flight, and the claims parked for a turn.
#[derive(Debug)]
pub struct Turns {
    state: Mutex<State>,
    /// One less than the workers (at least one): the most turns taken or kept at once.
    ceiling: usize,
    wake: UnboundedSender<ClaimRef>,
    wakeups: Mutex<Option<UnboundedReceiver<ClaimRef>>>,
}

/// Every class's turns and queue, and the counts shared between them.
#[derive(Debug, Default)]
struct State {
    classes: HashMap<String, ClassTurns>,
    /// Turns taken or kept for a woken claim, over every class.
    taken: usize,
    /// The same per guest.
    by_guest: HashMap<String, usize>,
    /// Classes with claims parked, in the order freed turns go round them.
    rotation: VecDeque<String>,
}

/// One class's attempts in flight and its queue.
#[derive(Debug, Default)]
struct ClassTurns {
    /// Its guest and that guest's limit (one less than its slots), as last seen.
    guest: String,
    guest_limit: usize,
    /// The class's own limit as last seen (its annotation can change).
    limit: usize,
    running: usize,
    /// Parked claims, longest parked first; `is_parked` says which entries still are (a claim
    /// forgotten by a refresh leaves its entry behind).
    parked: VecDeque<ClaimRef>,
    is_parked: HashSet<ClaimRef>,
    /// Claims woken for a freed turn and not back yet: the turn is kept for them.
    woken: HashMap<ClaimRef, Kept>,
}

/// A turn kept for a woken claim: since when, and whose guest slot it holds.
#[derive(Debug)]
struct Kept {
    at: Instant,
    guest: String,
}

impl ClassTurns {
    /// Nothing in flight, parked or woken: the class's entry can go.
    fn is_idle(&self) -> bool {
        self.running == 0 && self.is_parked.is_empty() && self.woken.is_empty()
    }
}

impl State {
    /// Whether a claim of `class` may take a turn now: one is free overall, for its guest and
    /// for the class.
    fn has_room(&self, class: &str, ceiling: usize) -> bool {
        let Some(turns) = self.classes.get(class) else {
            return false;
        };
        let guest_taken = self.by_guest.get(&turns.guest).copied().unwrap_or(0);
        self.taken < ceiling
            && guest_taken < turns.guest_limit
            && turns.running + turns.woken.len() < turns.limit
    }

    fn hold(&mut self, guest: &str) {
        self.taken += 1;
        *self.by_guest.entry(guest.to_owned()).or_default() += 1;
    }

    fn release(&mut self, guest: &str) {
        self.taken = self.taken.saturating_sub(1);
        if let Some(taken) = self.by_guest.get_mut(guest) {
            *taken -= 1;
            if *taken == 0 {
                self.by_guest.remove(guest);
            }
        }
    }

    /// Lets go of the turn kept for `claim`; whether there was one.
    fn unkeep(&mut self, class: &str, claim: &ClaimRef) -> bool {
        let kept = self
            .classes
            .get_mut(class)
            .and_then(|turns| turns.woken.remove(claim));
        kept.map(|kept| self.release(&kept.guest)).is_some()
    }

    /// Parks `claim` (once) at the back of its class's queue, or at the front when it was woken
    /// already and keeps its place.
    fn park(&mut self, class: &str, claim: ClaimRef, front: bool) {
        let Some(turns) = self.classes.get_mut(class) else {
            return;
        };
        if turns.is_parked.insert(claim.clone()) {
            if front {
                turns.parked.push_front(claim);
            } else {
                turns.parked.push_back(claim);
            }
        }
        if !self.rotation.iter().any(|queued| queued == class) {
            self.rotation.push_back(class.to_owned());
        }
    }

    /// Wakes the longest parked claim of `class` when a turn is free for it, keeping the turn.
    fn wake_next(&mut self, class: &str, ceiling: usize) -> Option<ClaimRef> {
        if !self.has_room(class, ceiling) {
            return None;
        }
        let turns = self.classes.get_mut(class)?;
        while let Some(claim) = turns.parked.pop_front() {
            if turns.is_parked.remove(&claim) {
                let guest = turns.guest.clone();
                let kept = Kept {
                    at: Instant::now(),
                    guest: guest.clone(),
                };
                turns.woken.insert(claim.clone(), kept);
                self.hold(&guest);
                return Some(claim);
            }
        }
        None
    }

    /// The parked claims to wake for the turns free: one class after another, round the
    /// classes with claims parked.
    fn fill(&mut self, ceiling: usize) -> Vec<ClaimRef> {
        let mut woken = Vec::new();
        // Classes looked at since the last claim woken: once all were, none can take a turn.
        let mut passed = 0;
        while self.taken < ceiling && passed < self.rotation.len() {
            let Some(class) = self.rotation.pop_front() else {
                break;
            };
            let next = self.wake_next(&class, ceiling);
            let waiting = self
                .classes
                .get(&class)
                .is_some_and(|turns| !turns.is_parked.is_empty());
            if waiting {
                self.rotation.push_back(class);
            }
            match next {
                Some(claim) => {
                    woken.push(claim);
                    passed = 0;
                }
                None if waiting => passed += 1,
                None => {}
            }
        }
        woken
    }
}

/// One attempt's turn, given back when dropped (waking the next parked claim).
#[derive(Debug)]
pub struct Turn<'a> {
    turns: &'a Turns,
    class: String,
    guest: String,
}

impl Turns {
    /// Turns for a controller with `workers` reconcile workers.
    pub fn new(workers: u16) -> Turns {
        let (wake, wakeups) = unbounded();
        Turns {
            state: Mutex::default(),
            ceiling: usize::from(workers).saturating_sub(1).max(1),
            wake,
            wakeups: Mutex::new(Some(wakeups)),
        }
    }

    /// How many attempts of `class` may be in flight at once: one less than the workers (at
    /// least one), and no more than the class's annotation.
    pub fn limit(&self, class: &StorageClass) -> usize {
        class_limit(class).map_or(self.ceiling, |annotated| annotated.min(self.ceiling))
    }

    /// Takes a turn for `claim` of `class`, served by `guest` with `guest_slots` calls at once,
    /// or parks it (once) to be woken through [`Turns::wakeups`] when a turn is its.
    ///
    /// First come, first served within a class: a claim that comes on its own (a retry come
    /// due, a change) neither takes the turn kept for a woken claim nor passes the claims parked
    /// before it. Otherwise retries coming due, each taking the turn freed a moment before, kept
    /// the claims parked longest waiting for minutes.
    pub fn acquire_or_park(
        &self,
        class: &StorageClass,
        guest: &str,
        guest_slots: usize,
        claim: ClaimRef,
    ) -> Option<Turn<'_>> {
        let name = class.metadata.name.clone().unwrap_or_default();
        let limit = self.limit(class);
        // One lock for the counts and the queues: a turn freed between a refusal and the
        // parking would otherwise find nobody to wake.
        let mut state = self.state.lock().expect("lock");
        let turns = state.classes.entry(name.clone()).or_default();
        turns.limit = limit;
        turns.guest_limit = guest_slots.saturating_sub(1).max(1);
        if turns.guest != guest {
            turns.guest = guest.to_owned();
        }
        // A woken claim's kept turn becomes its own, or its place at the front again when the
        // limits were lowered meanwhile.
        let was_woken = state.unkeep(&name, &claim);
        let first = was_woken || state.classes[&name].is_parked.is_empty();
        if first && state.has_room(&name, self.ceiling) {
            state.hold(guest);
            if let Some(turns) = state.classes.get_mut(&name) {
                turns.running += 1;
            }
            // A kept turn taken on another guest (a plugin reload) frees the old guest's slot,
            // and raised limits free turns: whoever waits for them goes now, not at a refresh.
            self.wake_all(state.fill(self.ceiling));
            return Some(Turn {
                turns: self,
                class: name,
                guest: guest.to_owned(),
            });
        }
        state.park(&name, claim, was_woken);
        self.wake_all(state.fill(self.ceiling));
        None
    }

    /// Lets go of whatever `claim` of `class` holds in the queue (its place, or the turn kept
    /// for it): it needs no turn now (bound, deleted, not ours), and the next one gets it at once.
    pub fn pass(&self, class: &str, claim: &ClaimRef) {
        let mut state = self.state.lock().expect("lock");
        let unkept = state.unkeep(class, claim);
        // Its entry leaves the queue too: parked again later, it goes to the back.
        let unparked = !unkept
            && state.classes.get_mut(class).is_some_and(|turns| {
                let was = turns.is_parked.remove(claim);
                if was {
                    turns.parked.retain(|queued| queued != claim);
                }
                was
            });
        if unkept || unparked {
            self.wake_all(state.fill(self.ceiling));
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
    /// claim woken longer than `kept_for` ago and not back (its wakeup waits behind others in
    /// kube-runtime's queue, or its reconcile stopped before taking the turn) is woken again,
    /// its turn still kept. Run every few seconds, this bounds how long a turn can stay kept for
    /// a claim that will never take it.
    pub fn refresh(&self, belongs: impl Fn(&str, &ClaimRef) -> bool, kept_for: Duration) {
        let mut state = self.state.lock().expect("lock");
        let classes: Vec<String> = state.classes.keys().cloned().collect();
        // Woken claims not back in time, woken again (longest waiting first), turns still kept.
        let mut again = Vec::new();
        for class in classes {
            let Some(turns) = state.classes.get_mut(&class) else {
                continue;
            };
            turns.is_parked.retain(|claim| belongs(&class, claim));
            let (mut gone, mut late) = (Vec::new(), Vec::new());
            for (claim, kept) in &mut turns.woken {
                if !belongs(&class, claim) {
                    gone.push(claim.clone());
                } else if kept.at.elapsed() >= kept_for {
                    late.push((kept.at, claim.clone()));
                    kept.at = Instant::now();
                }
            }
            late.sort_by_key(|(at, _)| *at);
            again.extend(late.into_iter().map(|(_, claim)| claim));
            let ClassTurns {
                parked, is_parked, ..
            } = turns;
            let mut seen = HashSet::new();
            parked.retain(|claim| is_parked.contains(claim) && seen.insert(claim.clone()));
            for claim in &gone {
                state.unkeep(&class, claim);
            }
        }
        state.classes.retain(|_, turns| !turns.is_idle());
        self.wake_all(again);
        self.wake_all(state.fill(self.ceiling));
    }

    fn wake_all(&self, claims: Vec<ClaimRef>) {
        for claim in claims {
            // The receiver is gone only at shutdown.
            let _ = self.wake.unbounded_send(claim);
        }
    }

    /// Attempts of `class` in flight.
    pub fn running(&self, class: &str) -> usize {
        let state = self.state.lock().expect("lock");
        state.classes.get(class).map_or(0, |turns| turns.running)
    }

    /// Claims parked, over every class.
    pub fn parked(&self) -> usize {
        let state = self.state.lock().expect("lock");
        state
            .classes
            .values()
            .map(|turns| turns.is_parked.len())
            .sum()
    }

    /// Classes with attempts in flight or claims parked or woken.
    pub fn classes(&self) -> usize {
        self.state.lock().expect("lock").classes.len()
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut state = self.turns.state.lock().expect("lock");
        state.release(&self.guest);
        if let Some(turns) = state.classes.get_mut(&self.class) {
            turns.running -= 1;
            if turns.is_idle() {
                state.classes.remove(&self.class);
            }
        }
        self.turns.wake_all(state.fill(self.turns.ceiling));
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

    /// A turn for `name` of `class`, served by guest `g`, which must get one.
    fn take<'a>(turns: &'a Turns, class: &StorageClass, name: &str) -> Turn<'a> {
        turns
            .acquire_or_park(class, "g", SLOTS, claim(name))
            .expect("a turn")
    }

    /// Parks each of `names`, which must find no turn.
    fn park(turns: &Turns, class: &StorageClass, names: &[&str]) {
        for name in names {
            assert!(
                turns
                    .acquire_or_park(class, "g", SLOTS, claim(name))
                    .is_none(),
                "{name} parked"
            );
        }
    }

    fn woken(wakeups: &mut UnboundedReceiver<ClaimRef>) -> Vec<String> {
        std::iter::from_fn(|| wakeups.try_recv().ok())
            .map(|claim| claim.name)
            .collect()
    }

    /// One turn for class `crowd`: `a` and `b` parked behind it, then `a` woken for it.
    fn a_woken_and_b_parked() -> (Turns, UnboundedReceiver<ClaimRef>) {
        let turns = Turns::new(2);
        let mut wakeups = turns.wakeups();
        let crowd = class("crowd", None);
        let held = take(&turns, &crowd, "held");
        park(&turns, &crowd, &["a", "b"]);
        drop(held);
        assert_eq!(woken(&mut wakeups), ["a"]);
        (turns, wakeups)
    }

    #[test]
    fn the_classes_together_leave_a_worker_over_and_freed_turns_go_round_them() {
        let turns = Turns::new(4);
        let mut wakeups = turns.wakeups();
        let (a, b, quiet) = (class("a", None), class("b", None), class("quiet", None));
        let held_a = [take(&turns, &a, "a-0"), take(&turns, &a, "a-1")];
        let held_b = take(&turns, &b, "b-0");
        park(&turns, &a, &["a-2", "a-3", "a-2", "a-gone"]);
        park(&turns, &b, &["b-1", "b-2"]);
        park(&turns, &quiet, &["q"]);
        assert_eq!(
            (turns.running("a"), turns.running("b"), turns.parked()),
            (2, 1, 6),
            "the fourth worker stays free for everyone; each claim parked once"
        );
        turns.refresh(|_, c| c.name != "a-gone", Duration::ZERO);
        assert!(woken(&mut wakeups).is_empty(), "no turn free: nobody woken");
        let [a0, a1] = held_a;
        drop(a0);
        drop(held_b);
        drop(a1);
        assert_eq!(
            woken(&mut wakeups),
            ["a-2", "b-1", "q"],
            "round the classes: the quiet class waits behind one claim of each crowd, not behind the crowds"
        );
        for (class, name) in [(&a, "a-2"), (&b, "b-1"), (&quiet, "q")] {
            drop(take(&turns, class, name));
        }
        assert_eq!(woken(&mut wakeups), ["a-3", "b-2"], "longest parked first");
        assert_eq!(turns.parked(), 0);
        assert_eq!(Turns::new(1).limit(&a), 1, "a single worker still works");
        assert_eq!(Turns::new(0).limit(&a), 1);
    }

    #[test]
    fn a_class_annotation_caps_its_own_claims_below_the_workers() {
        let turns = Turns::new(16);
        assert_eq!(turns.limit(&class("quiet", None)), 15);
        assert_eq!(turns.limit(&class("huge", Some("100"))), 15);
        assert_eq!(turns.limit(&class("junk", Some("x"))), 15);
        let storm = class("storm", Some("2"));
        let a = take(&turns, &storm, "a");
        let b = take(&turns, &storm, "b");
        park(&turns, &storm, &["c"]);
        let quiet: Vec<_> = (0..10)
            .map(|n| take(&turns, &class("quiet", None), &format!("q{n}")))
            .collect();
        drop(quiet);
        drop((a, b));
        drop(take(&turns, &storm, "c"));
        assert_eq!(
            turns.classes(),
            0,
            "a class with nothing in flight is forgotten"
        );
    }

    #[test]
    fn claims_never_take_their_guests_last_slot_over_every_class_it_serves() {
        let turns = Turns::new(16);
        let mut wakeups = turns.wakeups();
        let (x, y, z) = (class("x", None), class("y", None), class("z", None));
        let on = |class, guest, name: &str| turns.acquire_or_park(class, guest, 4, claim(name));
        let held = [on(&x, "g", "x-0"), on(&x, "g", "x-1"), on(&y, "g", "y-0")];
        assert!(held.iter().all(Option::is_some));
        assert!(
            on(&y, "g", "y-1").is_none(),
            "the guest's fourth slot is left to deletes"
        );
        let other = on(&z, "h", "z-0").expect("another guest has slots of its own");
        drop(other);
        drop(held);
        assert_eq!(woken(&mut wakeups), ["y-1"]);
        assert!(
            turns.acquire_or_park(&x, "solo", 1, claim("s")).is_some(),
            "a guest of one slot still serves claims"
        );
    }

    #[test]
    fn a_freed_turn_is_kept_for_the_claim_woken_for_it() {
        let (turns, mut wakeups) = a_woken_and_b_parked();
        let crowd = class("crowd", None);
        // A retry come due before `a` is back neither takes its turn nor passes `b`.
        park(&turns, &crowd, &["retry"]);
        drop(take(&turns, &crowd, "a"));
        assert_eq!(woken(&mut wakeups), ["b"]);
        drop(take(&turns, &crowd, "b"));
        assert_eq!(woken(&mut wakeups), ["retry"], "then the retry");
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
        assert_eq!(woken(&mut wakeups), ["a"]);
        // The class's limit was lowered before `a` came back: no turn, but `a` stays ahead of b.
        park(&turns, &class("storm", Some("1")), &["a"]);
        drop(second);
        assert_eq!(woken(&mut wakeups), ["a"], "a first");
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
        assert_eq!(woken(&mut wakeups), ["a"]);
        // `a` came back to find its PV made: its kept turn goes to `c`, not after a refresh.
        turns.pass("crowd", &claim("a"));
        assert_eq!(woken(&mut wakeups), ["c"]);
        turns.pass("nobody", &claim("x"));
    }

    #[test]
    fn a_refresh_wakes_parked_claims_for_turns_nobody_came_back_for() {
        let (turns, mut wakeups) = a_woken_and_b_parked();
        turns.refresh(|_, _| true, Duration::from_secs(60));
        assert!(
            woken(&mut wakeups).is_empty(),
            "a's turn is still kept for it"
        );
        // `a` was deleted meanwhile and never comes back: `b` waits though no turn is taken.
        assert_eq!((turns.running("crowd"), turns.parked()), (0, 1));
        turns.refresh(|_, c| c.name != "a", Duration::from_secs(60));
        assert_eq!(woken(&mut wakeups), ["b"]);
        assert_eq!(turns.parked(), 0);
        // Nor will `b`: it is of another class now. Nothing is left of the class or its turns.
        turns.refresh(|class, _| class != "crowd", Duration::from_secs(60));
        assert!(woken(&mut wakeups).is_empty());
        assert_eq!(turns.classes(), 0);
        let state = turns.state.lock().expect("lock");
        assert_eq!((state.taken, state.by_guest.len()), (0, 0));
    }

    #[test]
    fn a_woken_claim_slow_to_come_back_is_woken_again_keeping_its_turn() {
        let turns = Turns::new(2);
        let mut wakeups = turns.wakeups();
        let (crowd, other) = (class("crowd", None), class("other", None));
        let held = take(&turns, &crowd, "held");
        park(&turns, &crowd, &["a"]);
        drop(held);
        assert_eq!(woken(&mut wakeups), ["a"]);
        park(&turns, &other, &["o"]);
        // `a`'s wakeup waits behind others in kube-runtime's queue past the time kept. Before,
        // `a` gave its turn back and queued again, behind the other class, which took the turn.
        turns.refresh(|_, _| true, Duration::ZERO);
        assert_eq!(woken(&mut wakeups), ["a"], "woken again; o still waits");
        drop(take(&turns, &crowd, "a"));
        assert_eq!(woken(&mut wakeups), ["o"]);
    }

    #[test]
    fn a_claim_that_passed_its_place_and_parks_again_goes_to_the_back() {
        let turns = Turns::new(2);
        let mut wakeups = turns.wakeups();
        let crowd = class("crowd", None);
        let held = take(&turns, &crowd, "held");
        park(&turns, &crowd, &["x", "y"]);
        // `x` waited for its guest (passing its place), then came back: behind `y` now.
        turns.pass("crowd", &claim("x"));
        park(&turns, &crowd, &["x"]);
        drop(held);
        assert_eq!(woken(&mut wakeups), ["y"]);
    }

    #[test]
    fn a_kept_turn_taken_on_another_guest_frees_the_first_guests_slot_at_once() {
        let turns = Turns::new(16);
        let mut wakeups = turns.wakeups();
        let (x, y) = (class("x", None), class("y", None));
        // Guest `g` has two slots: one for claims.
        let on = |class, guest, name: &str| turns.acquire_or_park(class, guest, 2, claim(name));
        let held = on(&x, "g", "x-0").expect("g's slot");
        assert!(on(&x, "g", "c").is_none());
        assert!(on(&y, "g", "y-1").is_none());
        drop(held);
        assert_eq!(woken(&mut wakeups), ["c"], "g's slot kept for c");
        // A plugin reload serves class x with guest `h` now: `c` comes back to it.
        let c = on(&x, "h", "c").expect("a turn on h");
        assert_eq!(
            woken(&mut wakeups),
            ["y-1"],
            "g's slot went to y at once, not at the next refresh"
        );
        drop(c);
    }
}
