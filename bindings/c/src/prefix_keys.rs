//! Prefix keys: the byte strings an engine names its prefixes by (a block hash, a radix node's
//! token run), each interned to a table-wide id when it is published and forgotten when it is
//! evicted.
//!
//! Keys are interned, never hashed: two keys that collide in a hash would otherwise share a
//! prefix, which is exactly the cross-request read kvguard exists to refuse. Ids count up from 1
//! and are never reused, so an id looked up before a concurrent evict names nothing afterwards
//! (the core then says `unknown_prefix`). Memory stays bounded by the live prefixes.

use kvguard::PrefixKey;
use std::collections::HashMap;

/// The id no key is ever interned to: attaching, detaching or evicting an unpublished key asks
/// the core about it, which refuses it as `unknown_prefix` (counted and logged like any other).
const UNPUBLISHED: PrefixKey = PrefixKey(0);

/// The live prefixes' byte-string keys and their ids.
#[derive(Debug, Default)]
pub(crate) struct PrefixKeys {
    ids: HashMap<Box<[u8]>, PrefixKey>,
    last: u64,
}

impl PrefixKeys {
    /// The id of `key`, or one that names no prefix when it is not published.
    pub(crate) fn get(&self, key: &[u8]) -> PrefixKey {
        self.ids.get(key).copied().unwrap_or(UNPUBLISHED)
    }

    /// The id of `key` if it is published.
    pub(crate) fn published(&self, key: &[u8]) -> Option<PrefixKey> {
        self.ids.get(key).copied()
    }

    /// The id the next key published gets.
    pub(crate) fn next(&self) -> PrefixKey {
        PrefixKey(self.last + 1)
    }

    /// `key` is published under `id`, [`next`](Self::next) when it was taken.
    pub(crate) fn insert(&mut self, key: &[u8], id: PrefixKey) {
        self.last = id.0;
        self.ids.insert(key.into(), id);
    }

    /// `key` is evicted: forgotten.
    pub(crate) fn remove(&mut self, key: &[u8]) {
        self.ids.remove(key);
    }
}
