//! The hash maps keyed by the table's integer ids, and the hash they use.

use std::collections::HashMap;

/// Hashes the table's integer ids (requests, pages, prefix keys): foldhash, seeded at random
/// per map. SipHash cost more per request than a page's whole verification. foldhash's quality
/// variant finishes with a second folded multiply, so every input bit reaches the low bits a map
/// picks buckets with whatever the process's seed: ids crafted to collide (a hostile trace's, say)
/// still spread. The fast variant skips it, and for about one process seed in sixty ids differing
/// only above bit 47 fell into a seventh of the buckets.
pub(crate) type IdHash = foldhash::quality::RandomState;

/// A map keyed by one of the table's ids.
pub(crate) type IdMap<K, V> = HashMap<K, V, IdHash>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::RequestId;
    use std::collections::HashSet;

    #[test]
    fn ids_differing_only_in_high_bits_spread_over_the_low_bits() {
        // A hash map picks buckets with the low bits of the hash. Ids a hostile trace crafts to
        // differ only above bit 47 must still land in many different buckets, or each insert
        // probes a cluster as long as the map (131,072 such ids took seconds to admit).
        use std::hash::BuildHasher;
        let ids = 1u64 << 17;
        let mask = (1u64 << 16) - 1;
        let hasher = IdMap::<RequestId, ()>::default().hasher().clone();
        let low: HashSet<u64> = (0..ids).map(|i| hasher.hash_one(RequestId(i << 47)) & mask).collect();
        // Random hashes would fill about 87% of the 65,536 buckets; a quarter is generous. The
        // seed is the process's, so one run checks one seed: a hash that spreads only for most
        // seeds fails here now and then, which is how the fast variant was caught.
        assert!(low.len() as u64 > mask / 4, "{} of {} low-bit buckets used", low.len(), mask + 1);
    }
}
