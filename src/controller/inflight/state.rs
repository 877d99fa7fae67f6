//! The turns' bookkeeping: counts, queues and the round over the classes, with no lock and no
//! channel (see [`super::Turns`], the shell that locks it and sends the wakeups it decides).

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::runtime::reflector::ObjectRef;

/// A claim as its class's queue holds it.
pub(super) type ClaimRef = ObjectRef<PersistentVolumeClaim>;

/// Every class's turns and queue, and the counts shared between them.
#[derive(Debug)]
pub(super) struct State {
    /// One less than the workers (at least one): the most turns taken or kept at once.
    pub(super) ceiling: usize,
    classes: HashMap<String, ClassTurns>,
    /// Turns taken or kept for a woken claim, over every class.
    taken: usize,
    /// The same per guest.
    by_guest: HashMap<String, usize>,
    /// Classes with claims parked, in the order freed turns go round them.
    rotation: VecDeque<String>,
}

/// What bounds a claim's turn: its class's limit, and its guest with that guest's limit.
pub(super) struct Limits<'a> {
    pub class: usize,
    pub guest: &'a str,
    pub guest_limit: usize,
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
    /// Parked claims, longest parked first, and the same claims as a set (a queue may hold
    /// thousands; every reconcile asks whether its claim is in it).
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
    pub(super) fn new(ceiling: usize) -> State {
        State {
            ceiling,
            classes: HashMap::new(),
            taken: 0,
            by_guest: HashMap::new(),
            rotation: VecDeque::new(),
        }
    }

    /// Takes a turn for `claim` of `class` (true), or parks it (once) and returns false.
    /// First come, first served within a class: a claim that was not woken neither takes a
    /// kept turn nor passes the claims parked before it.
    pub(super) fn acquire(&mut self, class: &str, limits: Limits<'_>, claim: ClaimRef) -> bool {
        let turns = self.classes.entry(class.to_owned()).or_default();
        turns.limit = limits.class;
        turns.guest_limit = limits.guest_limit;
        if turns.guest != limits.guest {
            turns.guest = limits.guest.to_owned();
        }
        // A woken claim's kept turn becomes its own, or its place at the front again when the
        // limits were lowered meanwhile.
        let was_woken = self.unkeep(class, &claim);
        let first = was_woken || self.classes[class].is_parked.is_empty();
        if first && self.has_room(class) {
            self.hold(limits.guest);
            if let Some(turns) = self.classes.get_mut(class) {
                turns.running += 1;
            }
            return true;
        }
        self.park(class, claim, was_woken);
        false
    }

    /// A turn of `class` on `guest` ended.
    pub(super) fn finish(&mut self, class: &str, guest: &str) {
        self.release(guest);
        if let Some(turns) = self.classes.get_mut(class) {
            turns.running -= 1;
            if turns.is_idle() {
                self.classes.remove(class);
            }
        }
    }

    /// Lets go of whatever `claim` holds in its class's queue (its place, or the turn kept for
    /// it); whether it held anything. Parked again later, it goes to the back.
    pub(super) fn pass(&mut self, class: &str, claim: &ClaimRef) -> bool {
        if self.unkeep(class, claim) {
            return true;
        }
        self.classes.get_mut(class).is_some_and(|turns| {
            let was = turns.is_parked.remove(claim);
            if was {
                turns.parked.retain(|queued| queued != claim);
            }
            was
        })
    }

    /// Forgets claims `belongs` says no longer wait in their class, and returns those woken
    /// longer than `kept_for` ago and not back, to be woken again (longest waiting first), their
    /// turns still kept.
    pub(super) fn refresh(
        &mut self,
        belongs: impl Fn(&str, &ClaimRef) -> bool,
        kept_for: Duration,
    ) -> Vec<ClaimRef> {
        let classes: Vec<String> = self.classes.keys().cloned().collect();
        let mut again = Vec::new();
        for class in classes {
            let Some(turns) = self.classes.get_mut(&class) else {
                continue;
            };
            let ClassTurns {
                parked, is_parked, ..
            } = turns;
            parked.retain(|claim| {
                let stays = belongs(&class, claim);
                if !stays {
                    is_parked.remove(claim);
                }
                stays
            });
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
            for claim in &gone {
                self.unkeep(&class, claim);
            }
        }
        self.classes.retain(|_, turns| !turns.is_idle());
        again
    }

    /// The parked claims to wake for the turns free, each with its turn kept: one class after
    /// another, round the classes with claims parked.
    pub(super) fn fill(&mut self) -> Vec<ClaimRef> {
        let mut woken = Vec::new();
        // Classes looked at since the last claim woken: once all were, none can take a turn.
        let mut passed = 0;
        while self.taken < self.ceiling && passed < self.rotation.len() {
            let Some(class) = self.rotation.pop_front() else {
                break;
            };
            let next = self.wake_next(&class);
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

    /// Up to `count` claims whose turns come next, in the order they would come: those woken
    /// with a turn kept for them, then the parked ones, one class after another round the
    /// classes as [`State::fill`] wakes them. A guess, not a promise: limits change and claims go.
    pub(super) fn next_up(&self, count: usize) -> Vec<ClaimRef> {
        let mut next: Vec<ClaimRef> = self
            .classes
            .values()
            .flat_map(|turns| turns.woken.keys().cloned())
            .take(count)
            .collect();
        let queues: Vec<&VecDeque<ClaimRef>> = self
            .rotation
            .iter()
            .filter_map(|class| self.classes.get(class).map(|turns| &turns.parked))
            .collect();
        let mut depth = 0;
        while next.len() < count && queues.iter().any(|queue| queue.len() > depth) {
            for queue in &queues {
                if next.len() >= count {
                    break;
                }
                if let Some(claim) = queue.get(depth) {
                    next.push(claim.clone());
                }
            }
            depth += 1;
        }
        next
    }

    /// Attempts of `class` in flight.
    pub(super) fn running(&self, class: &str) -> usize {
        self.classes.get(class).map_or(0, |turns| turns.running)
    }

    /// Claims parked, over every class.
    pub(super) fn parked(&self) -> usize {
        self.classes
            .values()
            .map(|turns| turns.is_parked.len())
            .sum()
    }

    /// Classes with attempts in flight or claims parked or woken.
    pub(super) fn classes(&self) -> usize {
        self.classes.len()
    }

    /// Turns taken or kept, and guests holding any: both zero once nothing is in flight.
    #[cfg(test)]
    pub(super) fn taken(&self) -> (usize, usize) {
        (self.taken, self.by_guest.len())
    }

    /// Whether a claim of `class` may take a turn now: one is free overall, for its guest and
    /// for the class.
    fn has_room(&self, class: &str) -> bool {
        let Some(turns) = self.classes.get(class) else {
            return false;
        };
        let guest_taken = self.by_guest.get(&turns.guest).copied().unwrap_or(0);
        self.taken < self.ceiling
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
    fn wake_next(&mut self, class: &str) -> Option<ClaimRef> {
        if !self.has_room(class) {
            return None;
        }
        let turns = self.classes.get_mut(class)?;
        let claim = turns.parked.pop_front()?;
        turns.is_parked.remove(&claim);
        let guest = turns.guest.clone();
        let kept = Kept {
            at: Instant::now(),
            guest: guest.clone(),
        };
        turns.woken.insert(claim.clone(), kept);
        self.hold(&guest);
        Some(claim)
    }
}
