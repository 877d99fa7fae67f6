//! The instance pool: its size, the units of it one call holds, and the ledger of what the
//! loaded guests reserve, so that guests at their caps never exhaust it for one another.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use wasmtime::PoolingAllocationConfig;

use super::errors::LoadError;
use super::grants::{DEFAULT_INSTANCES, DEFAULT_TABLE_ELEMENTS};

/// Concurrent instances the pooling allocator is sized for (all guests together); calls beyond
/// it wait for a slot rather than fail to instantiate.
pub const POOL_INSTANCES: u32 = 128;

/// Core instances, and tables, in the pool: [`POOL_INSTANCES`] calls at the default grant's
/// cap each (slots are address space until used).
pub const POOL_CORE_INSTANCES: u32 = POOL_INSTANCES * DEFAULT_INSTANCES as u32;
/// Linear memories in the pool: [`POOL_INSTANCES`] calls of 2 each.
pub const POOL_MEMORIES: u32 = POOL_INSTANCES * 2;

/// The units of the pool one call of a guest holds: every call takes one component instance
/// and at most `instances` core instances, `instances` tables and `memories` memories (its
/// limiter's caps). A unit stands for one core instance and one table, an eighth of a component
/// instance and a quarter of a memory, so calls holding at most [`POOL_CORE_INSTANCES`] units
/// together can never exhaust any part of the pool, whatever their grants say.
pub fn pool_units(instances: usize, memories: usize) -> u32 {
    let per_call = (POOL_CORE_INSTANCES / POOL_INSTANCES) as usize;
    let per_memory = (POOL_CORE_INSTANCES / POOL_MEMORIES) as usize;
    let units = instances
        .max(per_call)
        .max(memories.saturating_mul(per_memory));
    units.min(POOL_CORE_INSTANCES as usize) as u32
}

/// What the loaded guests reserve of the pool: under each guest's name, the units its calls
/// hold at its `max-concurrency` ([`pool_units`] each), one entry per version alive (an old
/// version finishes its calls during a reload); a name counts once, at its largest entry.
#[derive(Default)]
pub(super) struct PoolLedger {
    by_guest: Mutex<HashMap<String, Vec<u64>>>,
}

impl PoolLedger {
    /// Reserves `calls x per_call` units for guest `guest`, or refuses when the other guests
    /// leave less: the sum over loaded guests at their caps always fits the pool, so no
    /// guest's call waits for another guest's units (the per-call semaphore can only block
    /// while an old and a new version of one guest both have calls in flight during a reload).
    pub(super) fn reserve(
        self: &Arc<Self>,
        guest: &str,
        calls: usize,
        per_call: u32,
    ) -> Result<PoolReservation, LoadError> {
        let units = (calls as u64).saturating_mul(per_call as u64);
        let mut by_guest = self.by_guest.lock().unwrap_or_else(|e| e.into_inner());
        let reserved: u64 = by_guest
            .iter()
            .filter(|(name, _)| name.as_str() != guest)
            .map(|(_, entries)| entries.iter().copied().max().unwrap_or(0))
            .sum();
        if reserved.saturating_add(units) > POOL_CORE_INSTANCES as u64 {
            return Err(LoadError::Pool {
                guest: guest.to_owned(),
                needs: units,
                calls,
                per_call,
                reserved,
                total: POOL_CORE_INSTANCES,
            });
        }
        by_guest.entry(guest.to_owned()).or_default().push(units);
        Ok(PoolReservation {
            ledger: self.clone(),
            guest: guest.to_owned(),
            units,
        })
    }
}

/// One loaded guest version's share of the pool, given back when its last clone is dropped.
pub(super) struct PoolReservation {
    ledger: Arc<PoolLedger>,
    guest: String,
    units: u64,
}

impl Drop for PoolReservation {
    fn drop(&mut self) {
        let mut by_guest = self
            .ledger
            .by_guest
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(entries) = by_guest.get_mut(&self.guest) {
            if let Some(at) = entries.iter().position(|u| *u == self.units) {
                entries.swap_remove(at);
            }
            if entries.is_empty() {
                by_guest.remove(&self.guest);
            }
        }
    }
}

/// Bytes of each pooled memory and table kept resident between calls. A slot is reset to its
/// initial contents either way: with the kernel's `PAGEMAP_SCAN` (Linux 6.7+) only the pages
/// the last call dirtied are rewritten, so the next call takes no page faults there and the
/// reset needs no `madvise` (whose TLB shootdown interrupts the other CPUs); without it the
/// low bytes are rewritten with `memset`.
pub const POOL_KEEP_RESIDENT: usize = 256 << 10;

/// The pool: memories up to the largest grant (4 GiB; each guest's own cap is enforced by its
/// limiter), room for [`POOL_INSTANCES`] component instances, the first
/// [`POOL_KEEP_RESIDENT`] bytes of each slot kept resident, the rest returned to the OS on reuse.
pub(super) fn allocation() -> PoolingAllocationConfig {
    let mut pool = PoolingAllocationConfig::new();
    pool.total_component_instances(POOL_INSTANCES)
        .total_core_instances(POOL_CORE_INSTANCES)
        .total_memories(POOL_MEMORIES)
        .total_tables(POOL_CORE_INSTANCES)
        .total_stacks(POOL_INSTANCES)
        .max_memory_size(4 << 30)
        .table_elements(DEFAULT_TABLE_ELEMENTS)
        .linear_memory_keep_resident(POOL_KEEP_RESIDENT)
        .table_keep_resident(POOL_KEEP_RESIDENT)
        .pagemap_scan(wasmtime::Enabled::Auto);
    pool
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_at_their_caps_never_exhaust_the_pool() {
        for (instances, memories) in [(1, 1), (2, 2), (8, 2), (32, 2), (32, 16), (1000, 16)] {
            let units = pool_units(instances, memories);
            let calls = POOL_CORE_INSTANCES / units;
            assert!(
                calls <= POOL_INSTANCES,
                "{instances}/{memories}: component instances"
            );
            assert!(
                calls as usize * instances.min(POOL_CORE_INSTANCES as usize)
                    <= POOL_CORE_INSTANCES as usize,
                "{instances}/{memories}: core instances and tables"
            );
            assert!(
                calls as usize * memories <= POOL_MEMORIES as usize,
                "{instances}/{memories}: memories"
            );
            assert!(calls >= 1, "a call always fits");
        }
        // The default grant still gets all 128 calls (before, 128 calls of up to 32 core
        // instances each shared 1,024 slots); a grant raising its caps gets fewer.
        assert_eq!(POOL_CORE_INSTANCES / pool_units(32, 2), POOL_INSTANCES);
        assert_eq!(POOL_CORE_INSTANCES / pool_units(1000, 2), 4);
    }

    #[test]
    fn the_loaded_guests_reservations_never_exceed_the_pool() {
        let ledger = Arc::new(PoolLedger::default());
        let per_call = pool_units(32, 2);
        // 32 guests of the default grant (4 calls of 32 units) fill the pool exactly.
        let mut held: Vec<_> = (0..32)
            .map(|i| ledger.reserve(&format!("g{i}"), 4, per_call).unwrap())
            .collect();
        let refused = ledger.reserve("one-more", 4, per_call).err().unwrap();
        assert!(
            refused
                .to_string()
                .contains("needs 128 units of the instance pool"),
            "{refused}"
        );
        // A new version of a loaded guest (a reload) counts once, at the larger reservation.
        let reload = ledger.reserve("g0", 4, per_call).unwrap();
        assert!(
            ledger.reserve("g1", 5, per_call).is_err(),
            "g1 grows past the pool"
        );
        drop(held.pop());
        drop(reload);
        ledger.reserve("one-more", 4, per_call).unwrap();
        // One grant alone larger than the pool never loads.
        let alone = Arc::new(PoolLedger::default());
        assert!(alone.reserve("greedy", 129, per_call).is_err());
        assert!(alone.reserve("greedy", 128, per_call).is_ok());
    }
}
