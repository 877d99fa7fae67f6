//! Turns' order, limits and kept turns, driven through [`Turns`] as the claim path drives it.

use super::*;
use crate::controller::plan::ANN_MAX_IN_FLIGHT;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::reflector::ObjectRef;

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
fn a_guests_turns_are_a_few_per_claim_slot_over_every_class_it_serves() {
    let turns = Turns::new(64);
    let mut wakeups = turns.wakeups();
    let (x, y, z) = (class("x", None), class("y", None), class("z", None));
    // Four slots: three for claims' calls (the fourth is a delete's), eight turns each.
    assert_eq!(super::guest_turns(4), 24);
    let on = |class, guest, name: &str| turns.acquire_or_park(class, guest, 4, claim(name));
    let held: Vec<_> = (0..24)
        .map(|n| {
            let class = if n % 2 == 0 { &x } else { &y };
            on(class, "g", &format!("c-{n}"))
        })
        .collect();
    assert!(held.iter().all(Option::is_some));
    assert!(
        on(&y, "g", "y-1").is_none(),
        "the guest's turns are taken, over both its classes"
    );
    let other = on(&z, "h", "z-0").expect("another guest has turns of its own");
    drop(other);
    drop(held);
    assert_eq!(woken(&mut wakeups), ["y-1"]);
    assert_eq!(
        super::guest_turns(1),
        8,
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
    assert_eq!(turns.lock().taken(), (0, 0), "no turn taken or kept");
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
    // Guest `g` has two slots: one for claims, eight turns.
    let on = |class, guest, name: &str| turns.acquire_or_park(class, guest, 2, claim(name));
    let mut others: Vec<_> = (0..7)
        .map(|n| on(&y, "g", &format!("y-held-{n}")))
        .collect();
    assert!(others.iter().all(Option::is_some));
    let held = on(&x, "g", "x-0").expect("g's last turn");
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
    others.clear();
}
