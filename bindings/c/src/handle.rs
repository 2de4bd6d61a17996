//! Handles: what C holds for a table, an import ticket or a manifest is an id, never an address.
//! A process-wide registry per type maps the live ids to their objects, and every entry point
//! looks its handle up there. An id is never reused (each slot's generation only grows, and a
//! slot retires rather than let a generation repeat), so a freed handle, a second free, or a
//! handle of another type is refused with `KVG_STATUS_INVALID_HANDLE`, also after the allocator
//! reused the freed memory: the handle is never dereferenced.
//!
//! A handle is `generation << HALF | index << KIND_BITS | kind`, `HALF` being half the bits of a
//! pointer. Each slot keeps one atomic word, its generation, whether it is live, and how many
//! [`Held`]s hold it: a lookup is one compare-and-swap on that word and the end of the call one
//! subtraction, with no lock, so calls on different handles never touch the same memory, and a
//! free never waits for a call in flight: the object is dropped when the last holder lets go
//! (an `Arc`, counted in the slot).

use crate::status::{Failure, kvg_status};
use parking_lot::Mutex;
use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};

/// Objects of every type alive in the process: made, and not yet dropped.
static ALIVE: AtomicUsize = AtomicUsize::new(0);

/// How many kvguard objects (tables, import tickets, manifests) are alive in the process: made
/// and not yet freed or ended (a table freed while a call in another thread still runs on it
/// counts until that call returns). An engine that frees what it made reads 0 at shutdown: a
/// leak check that sanitizers cannot make, since a live handle stays reachable from kvguard's
/// registry.
#[unsafe(no_mangle)]
pub extern "C" fn kvg_live_handles() -> usize {
    ALIVE.load(Ordering::Acquire)
}

/// The types of handle, in the low bits of each, so that one passed as another is told apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Table = 1,
    ImportTicket = 2,
    Manifest = 3,
    RowCache = 4,
    SlotRowCache = 5,
    HeldRows = 6,
}

impl Kind {
    fn from_bits(bits: usize) -> Option<Kind> {
        match bits {
            1 => Some(Kind::Table),
            2 => Some(Kind::ImportTicket),
            3 => Some(Kind::Manifest),
            4 => Some(Kind::RowCache),
            5 => Some(Kind::SlotRowCache),
            6 => Some(Kind::HeldRows),
            _ => None,
        }
    }

    /// The C type's name.
    fn c_name(self) -> &'static str {
        match self {
            Kind::Table => "kvg_table",
            Kind::ImportTicket => "kvg_import_ticket",
            Kind::Manifest => "kvg_manifest",
            Kind::RowCache => "kvg_row_cache",
            Kind::SlotRowCache => "kvg_slot_row_cache",
            Kind::HeldRows => "kvg_held_rows",
        }
    }

    /// How a handle of this type stops being live.
    fn ended_by(self) -> &'static str {
        match self {
            Kind::Table => "freed by kvg_table_free",
            Kind::ImportTicket => {
                "ended by kvg_import_finish or kvg_import_abort, or aborted by kvg_table_free of its table"
            }
            Kind::Manifest => "freed by kvg_manifest_free",
            Kind::RowCache => "freed by kvg_row_cache_free",
            Kind::SlotRowCache => "freed by kvg_slot_row_cache_free",
            Kind::HeldRows => "freed by kvg_held_rows_free",
        }
    }
}

const KIND_BITS: u32 = 3;
const KIND_MASK: usize = (1 << KIND_BITS) - 1;
const HALF: u32 = usize::BITS / 2;
const INDEX_MASK: usize = (1 << (HALF - KIND_BITS)) - 1;
/// The last generation a slot may hold; a slot freed at it retires.
const MAX_GENERATION: u64 = (1 << HALF) - 1;
/// Slots per chunk; chunks are allocated as handles are made, and never move or go.
/// (64 slots: a table is under 1 KiB, so the first one costs about 57 KiB of slots.)
const CHUNK: usize = 64;
const CHUNKS: usize = 4096;
/// Live handles per type: 2^18 (262,144) on 64-bit targets; what the index bits allow on
/// smaller ones. One more is refused with `KVG_STATUS_OUT_OF_MEMORY`.
const CAPACITY: usize = if CHUNK * CHUNKS <= INDEX_MASK { CHUNK * CHUNKS } else { INDEX_MASK + 1 };

// A slot's word: generation in the high 32 bits, `LIVE`, then the holders.
const LIVE: u64 = 1 << 31;
const HOLDERS: u64 = LIVE - 1;

fn generation_of(state: u64) -> u64 {
    state >> 32
}

/// One slot: its word, and the object while the slot is live or held.
struct Slot<T> {
    state: AtomicU64,
    value: UnsafeCell<MaybeUninit<T>>,
}

/// Vacant slots that may be reused, and the first slot never used.
struct Vacant {
    reuse: Vec<usize>,
    unused: usize,
}

/// The live handles of one type.
pub(crate) struct Registry<T: 'static> {
    kind: Kind,
    chunks: [OnceLock<Box<[Slot<T>]>>; CHUNKS],
    vacant: Mutex<Vacant>,
}

// SAFETY: the objects are reached from any thread, shared by `Held` (so `T: Sync`) and dropped
// by whichever thread lets go last (so `T: Send`); a slot's value is written only while no
// handle names it (not live, no holder) and read only while held.
unsafe impl<T: Send + Sync> Sync for Registry<T> {}

/// A live object, held: it is not dropped while this lives, even if its handle is freed.
pub(crate) struct Held<T: Send + Sync + 'static> {
    registry: &'static Registry<T>,
    slot: &'static Slot<T>,
    index: usize,
}

// SAFETY: a `Held` gives `&T` (so `T: Sync`), and its drop may drop the `T` (so `T: Send`).
unsafe impl<T: Send + Sync> Send for Held<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for Held<T> {}

impl<T: Send + Sync> std::ops::Deref for Held<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: a holder is counted in the slot's word, so the value stays initialised and is
        // neither dropped nor replaced until this `Held` is dropped.
        unsafe { (*self.slot.value.get()).assume_init_ref() }
    }
}

impl<T: Send + Sync> Drop for Held<T> {
    fn drop(&mut self) {
        let before = self.slot.state.fetch_sub(1, Ordering::Release);
        if before & LIVE == 0 && before & HOLDERS == 1 {
            self.last_holder_gone(before);
        }
    }
}

impl<T: Send + Sync> Held<T> {
    /// The handle was freed and this was its last holder: the value goes.
    #[cold]
    #[inline(never)]
    fn last_holder_gone(&self, state: u64) {
        // See every other holder's use before dropping the value (as `Arc`'s drop does).
        fence(Ordering::Acquire);
        // SAFETY: not live and no holder left: nothing can reach the value any more.
        drop(unsafe { self.registry.vacate(self.index, state - 1) });
    }
}

impl<T: Send + Sync> Registry<T> {
    pub(crate) const fn new(kind: Kind) -> Registry<T> {
        Registry {
            kind,
            chunks: [const { OnceLock::new() }; CHUNKS],
            vacant: Mutex::new(Vacant { reuse: Vec::new(), unused: 0 }),
        }
    }

    /// Slot `index`, whose chunk exists (it was handed out, or `decode` found its chunk).
    fn slot(&self, index: usize) -> &Slot<T> {
        match self.chunks[index / CHUNK].get() {
            Some(chunk) => &chunk[index % CHUNK],
            None => unreachable!("slot {index} was handed out, so its chunk exists"),
        }
    }

    /// Registers `value`; its handle, never 0 and never one handed out before.
    pub(crate) fn insert(&'static self, value: T) -> Result<usize, Failure> {
        let index = {
            let mut vacant = self.vacant.lock();
            match vacant.reuse.pop() {
                Some(index) => index,
                None if vacant.unused < CAPACITY => {
                    vacant.unused += 1;
                    vacant.unused - 1
                }
                None => {
                    return Err(Failure::status(
                        kvg_status::OutOfMemory,
                        format!("{CAPACITY} live {} handles: no room for another", self.kind.c_name()),
                    ));
                }
            }
        };
        let chunk = self.chunks[index / CHUNK].get_or_init(|| {
            (0..CHUNK)
                .map(|_| Slot { state: AtomicU64::new(1 << 32), value: UnsafeCell::new(MaybeUninit::uninit()) })
                .collect()
        });
        let slot = &chunk[index % CHUNK];
        let state = slot.state.load(Ordering::Acquire);
        // SAFETY: the slot is vacant (taken from the vacant list under its lock, or never used):
        // not live, so no lookup can hold it, and no holder is left; this thread alone owns it.
        unsafe { (*slot.value.get()).write(value) };
        slot.state.store(state | LIVE, Ordering::Release);
        ALIVE.fetch_add(1, Ordering::Release);
        Ok((generation_of(state) as usize) << HALF | index << KIND_BITS | self.kind as usize)
    }

    /// The slot a handle of this registry's kind names, with the generation the handle names
    /// it in; `None` when the handle cannot be one of this registry's (see [`Self::refusal`]).
    #[inline]
    fn locate(&'static self, handle: usize) -> Option<(usize, u64, &'static Slot<T>)> {
        if handle & KIND_MASK != self.kind as usize {
            return None;
        }
        let index = (handle >> KIND_BITS) & INDEX_MASK;
        if index >= CAPACITY {
            return None;
        }
        let chunk = self.chunks[index / CHUNK].get()?;
        Some((index, (handle >> HALF) as u64, &chunk[index % CHUNK]))
    }

    /// Holds the live object behind `handle` (`what` names the argument in messages).
    #[inline]
    pub(crate) fn get(&'static self, handle: usize, what: &str) -> Result<Held<T>, Failure> {
        if let Some((index, generation, slot)) = self.locate(handle) {
            let mut state = slot.state.load(Ordering::Relaxed);
            while generation_of(state) == generation && state & LIVE != 0 && state & HOLDERS != HOLDERS {
                match slot.state.compare_exchange_weak(state, state + 1, Ordering::Acquire, Ordering::Relaxed) {
                    Ok(_) => return Ok(Held { registry: self, slot, index }),
                    Err(now) => state = now,
                }
            }
        }
        Err(self.refusal(handle, what))
    }

    /// Ends `handle`: it names nothing from now on. The object comes back when nothing holds it;
    /// otherwise the last holder drops it, and `None` comes back.
    pub(crate) fn remove(&'static self, handle: usize, what: &str) -> Result<Option<T>, Failure> {
        let Some((index, generation, slot)) = self.locate(handle) else {
            return Err(self.refusal(handle, what));
        };
        let mut state = slot.state.load(Ordering::Relaxed);
        loop {
            if generation_of(state) != generation || state & LIVE == 0 {
                return Err(self.refusal(handle, what));
            }
            match slot.state.compare_exchange_weak(state, state & !LIVE, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => state = now,
            }
        }
        if state & HOLDERS != 0 {
            return Ok(None);
        }
        // SAFETY: this call made the slot not live and no holder was left: nothing can reach it.
        Ok(Some(unsafe { self.vacate(index, state & !LIVE) }))
    }

    /// Why `handle` names no live object of this registry: NULL, another type's, never a
    /// handle, ended already (its slot is past its generation, or at it and not live), or held
    /// by too many calls at once.
    #[cold]
    #[inline(never)]
    fn refusal(&'static self, handle: usize, what: &str) -> Failure {
        let c_name = self.kind.c_name();
        if handle == 0 {
            return Failure::status(kvg_status::NullPointer, format!("{what} is NULL"));
        }
        let text = match (Kind::from_bits(handle & KIND_MASK), self.locate(handle)) {
            (Some(other), _) if other != self.kind => {
                format!("{what} is a {} handle, not a {c_name}", other.c_name())
            }
            (_, Some((_, generation, slot))) => {
                let state = slot.state.load(Ordering::Relaxed);
                if generation != 0 && generation < generation_of(state)
                    || generation == generation_of(state) && state & LIVE == 0
                {
                    format!("{what} ({handle:#x}) is a {c_name} already {}", self.kind.ended_by())
                } else if generation == generation_of(state) {
                    format!("{what} is held by too many calls at once")
                } else {
                    format!("{what} ({handle:#x}) is not a {c_name} handle (never made by kvguard)")
                }
            }
            _ => format!("{what} ({handle:#x}) is not a {c_name} handle (never made by kvguard)"),
        };
        Failure::status(kvg_status::InvalidHandle, text)
    }

    /// Moves the value out of a slot nothing can reach any more, and makes the slot vacant
    /// under its next generation (or retires it, its generations spent).
    ///
    /// # Safety
    /// The slot is not live and has no holder; `state` is its word; this runs once per value.
    unsafe fn vacate(&self, index: usize, state: u64) -> T {
        let slot = self.slot(index);
        // SAFETY: the caller's contract: the value is initialised and nothing else reaches it.
        let value = unsafe { (*slot.value.get()).assume_init_read() };
        ALIVE.fetch_sub(1, Ordering::Release);
        let generation = generation_of(state);
        if generation < MAX_GENERATION {
            slot.state.store((generation + 1) << 32, Ordering::Release);
            self.vacant.lock().reuse.push(index);
        }
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status<T>(r: Result<T, Failure>) -> kvg_status {
        match r {
            Ok(_) => kvg_status::Ok,
            Err(Failure::Status(s, _)) => s,
            Err(other) => panic!("a registry fails with a status of its own, not {other:?}"),
        }
    }

    fn registry(kind: Kind) -> &'static Registry<u32> {
        Box::leak(Box::new(Registry::new(kind)))
    }

    #[test]
    fn a_removed_handle_is_dead_even_when_its_slot_is_reused() {
        let r = registry(Kind::Table);
        let handles: Vec<usize> = (0..4).map(|v| r.insert(v).unwrap()).collect();
        let h = handles[2];
        assert_eq!(*r.get(h, "t").unwrap(), 2);
        assert_eq!(r.remove(h, "t").unwrap(), Some(2));
        assert_eq!(status(r.get(h, "t")), kvg_status::InvalidHandle);
        assert_eq!(status(r.remove(h, "t")), kvg_status::InvalidHandle);
        // The slot is reused, under a new generation: the old handle still names nothing.
        let fresh = r.insert(100).unwrap();
        assert_eq!(fresh & ((1 << HALF) - 1), h & ((1 << HALF) - 1), "the vacant slot is reused");
        assert_ne!(fresh, h, "a handle value is never handed out twice");
        assert_eq!(status(r.get(h, "t")), kvg_status::InvalidHandle);
        assert_eq!(*r.get(fresh, "t").unwrap(), 100);
        for (i, &h) in handles.iter().enumerate().filter(|&(i, _)| i != 2) {
            assert_eq!(*r.get(h, "t").unwrap(), i as u32);
        }
    }

    #[test]
    fn a_held_object_outlives_its_free_and_goes_with_its_last_holder() {
        let r: &'static Registry<std::sync::Arc<()>> = Box::leak(Box::new(Registry::new(Kind::Table)));
        let object = std::sync::Arc::new(());
        let h = r.insert(object.clone()).unwrap();
        let (a, b) = (r.get(h, "t").unwrap(), r.get(h, "t").unwrap());
        assert_eq!(r.remove(h, "t").unwrap(), None, "held: dropped by the last holder");
        assert_eq!(status(r.get(h, "t")), kvg_status::InvalidHandle);
        assert_eq!(std::sync::Arc::strong_count(&a), 2, "still alive while held");
        drop(a);
        assert_eq!(std::sync::Arc::strong_count(&object), 2);
        drop(b);
        assert_eq!(std::sync::Arc::strong_count(&object), 1, "dropped with its last holder");
    }

    #[test]
    fn racing_calls_and_frees_free_once_and_drop_once() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicUsize;
        let r: &'static Registry<Arc<()>> = Box::leak(Box::new(Registry::new(Kind::Table)));
        let object = Arc::new(());
        for _ in 0..200 {
            let h = r.insert(object.clone()).unwrap();
            let frees = AtomicUsize::new(0);
            std::thread::scope(|s| {
                for _ in 0..3 {
                    s.spawn(|| {
                        for _ in 0..100 {
                            if let Ok(held) = r.get(h, "t") {
                                assert!(Arc::strong_count(&held) >= 2, "held, so not dropped");
                            }
                        }
                    });
                }
                for _ in 0..2 {
                    s.spawn(|| {
                        if r.remove(h, "t").is_ok() {
                            frees.fetch_add(1, Ordering::Relaxed);
                        }
                    });
                }
            });
            assert_eq!(frees.load(Ordering::Relaxed), 1, "of two racing frees, one wins");
            assert_eq!(Arc::strong_count(&object), 1, "dropped once its last holder let go");
            assert_eq!(status(r.get(h, "t")), kvg_status::InvalidHandle);
        }
    }

    #[test]
    fn null_foreign_and_invented_handles_are_refused() {
        let tables = registry(Kind::Table);
        let manifests = registry(Kind::Manifest);
        let m = manifests.insert(1).unwrap();
        let live = tables.insert(1).unwrap();
        assert_eq!(live, 1 << HALF | 1, "generation 1, slot 0, a table");
        assert_eq!(status(tables.get(0, "t")), kvg_status::NullPointer);
        assert_eq!(status(tables.get(m, "t")), kvg_status::InvalidHandle);
        // Anything but `live` itself: a later generation, a slot never used, no kind, an address.
        for invented in [4, 0x1000, usize::MAX, 2 << HALF | 1, 1 << HALF | 5 << KIND_BITS | 1, 0x7f00_1234_5670] {
            assert_eq!(status(tables.get(invented, "t")), kvg_status::InvalidHandle, "{invented:#x}");
        }
    }

    #[test]
    fn a_slot_retires_when_its_generations_are_spent() {
        let r = registry(Kind::Table);
        let h = r.insert(1).unwrap();
        let (_, _, slot) = r.locate(h).unwrap();
        slot.state.store(MAX_GENERATION << 32 | LIVE, Ordering::Relaxed);
        let last = (h & ((1 << HALF) - 1)) | (MAX_GENERATION as usize) << HALF;
        assert_eq!(r.remove(last, "t").unwrap(), Some(1));
        assert!(r.vacant.lock().reuse.is_empty(), "the spent slot is not reused");
        assert_eq!(status(r.get(last, "t")), kvg_status::InvalidHandle);
        assert_ne!(r.insert(2).unwrap() & ((1 << HALF) - 1), h & ((1 << HALF) - 1));
    }
}
