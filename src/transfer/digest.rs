//! The prompt digest: what the sender says it prefilled, checked against what the receiver holds.
//!
//! The digest is XXH64 (seed 0) of the prompt's token ids serialized as little-endian `u32`s, so
//! it is stable across Rust versions, platforms and implementations (any XXH64 library gives the
//! same value for the same bytes). XXH64 folds the byte length in, so a truncated prompt differs
//! even when its tokens are a prefix of the real one.
//!
//! **Strength, honestly**: a 64-bit non-cryptographic hash. It catches accidents — a one-token
//! dummy substituted for the prompt, a truncated prompt, another request's prompt — with a miss
//! chance of about 2^-64 per transfer. It does not stop an adversary who controls the sender: such
//! a sender computes the KV itself and can forge anything a digest could bind.

use std::fmt;

/// The digest of a prompt's token ids (XXH64, seed 0, over the ids as little-endian `u32`s).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct PromptDigest(pub u64);

impl PromptDigest {
    /// The digest of `tokens`.
    ///
    /// ```
    /// use kvguard::transfer::PromptDigest;
    /// let real = PromptDigest::of_tokens(&[101, 2023, 2003, 1037, 3231]);
    /// assert_ne!(real, PromptDigest::of_tokens(&[101])); // a one-token dummy
    /// assert_eq!(real, PromptDigest::of_tokens(&[101, 2023, 2003, 1037, 3231]));
    /// ```
    pub fn of_tokens(tokens: &[u32]) -> PromptDigest {
        PromptDigest(xxh64_tokens(tokens))
    }
}

impl fmt::Display for PromptDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;
const P5: u64 = 0x27D4_EB2F_1656_67C5;

#[inline(always)]
fn round(acc: u64, input: u64) -> u64 {
    acc.wrapping_add(input.wrapping_mul(P2)).rotate_left(31).wrapping_mul(P1)
}

#[inline(always)]
fn merge(acc: u64, val: u64) -> u64 {
    (acc ^ round(0, val)).wrapping_mul(P1).wrapping_add(P4)
}

/// Two consecutive tokens as the little-endian `u64` their bytes form.
#[inline(always)]
fn pair(lo: u32, hi: u32) -> u64 {
    u64::from(lo) | (u64::from(hi) << 32)
}

/// XXH64 (seed 0) of the little-endian bytes of `tokens`, without materializing the bytes.
///
/// Written here rather than taken from `xxhash-rust` (the tests' oracle) because it reads the
/// tokens in place: a maintained XXH64 needs the bytes, and safe Rust must copy them first. Median
/// of 11 runs, one core, release build, random token ids:
///
/// | prompt                 | this function | `xxhash-rust` over a copy | `xxhash-rust` in place (unsafe cast) |
/// |------------------------|---------------|---------------------------|--------------------------------------|
/// | 1 Ki tokens (4 KiB)    | 0.29 µs       | 0.37 µs                   | 0.29 µs                              |
/// | 32 Ki tokens (128 KiB) | 9.0 µs        | 11.3 µs                   | 9.0 µs                               |
/// | 1 Mi tokens (4 MiB)    | 294 µs        | 367 µs                    | 290 µs                               |
fn xxh64_tokens(tokens: &[u32]) -> u64 {
    let len_bytes = (tokens.len() as u64).wrapping_mul(4);
    let mut stripes = tokens.chunks_exact(8);
    let mut h = if tokens.len() >= 8 {
        let (mut v1, mut v2, mut v3, mut v4) = (P1.wrapping_add(P2), P2, 0u64, 0u64.wrapping_sub(P1));
        for s in &mut stripes {
            v1 = round(v1, pair(s[0], s[1]));
            v2 = round(v2, pair(s[2], s[3]));
            v3 = round(v3, pair(s[4], s[5]));
            v4 = round(v4, pair(s[6], s[7]));
        }
        let h = v1
            .rotate_left(1)
            .wrapping_add(v2.rotate_left(7))
            .wrapping_add(v3.rotate_left(12))
            .wrapping_add(v4.rotate_left(18));
        merge(merge(merge(merge(h, v1), v2), v3), v4)
    } else {
        P5
    };
    h = h.wrapping_add(len_bytes);
    let rest = stripes.remainder();
    let mut pairs = rest.chunks_exact(2);
    for p in &mut pairs {
        h ^= round(0, pair(p[0], p[1]));
        h = h.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
    }
    if let [last] = pairs.remainder() {
        h ^= u64::from(*last).wrapping_mul(P1);
        h = h.rotate_left(23).wrapping_mul(P2).wrapping_add(P3);
    }
    avalanche(h)
}

#[inline(always)]
fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The little-endian bytes of `tokens`, as the digest is defined over them.
    fn le_bytes(tokens: &[u32]) -> Vec<u8> {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    #[test]
    fn empty_prompt_digest_is_the_published_xxh64_of_no_bytes() {
        assert_eq!(PromptDigest::of_tokens(&[]).0, 0xEF46_DB37_51D8_E999);
    }

    #[test]
    fn token_digest_equals_xxh64_of_the_little_endian_bytes() {
        let mut x = 0x1234_5678u32;
        for len in (0..80usize).chain([255, 256, 257, 1023, 4096 + 3]) {
            let tokens: Vec<u32> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    x
                })
                .collect();
            let oracle = xxhash_rust::xxh64::xxh64(&le_bytes(&tokens), 0);
            assert_eq!(PromptDigest::of_tokens(&tokens).0, oracle, "len {len}");
        }
    }

    #[test]
    fn truncation_and_substitution_change_the_digest() {
        let prompt: Vec<u32> = (0..1000).collect();
        let d = PromptDigest::of_tokens(&prompt);
        assert_ne!(d, PromptDigest::of_tokens(&prompt[..999]));
        assert_ne!(d, PromptDigest::of_tokens(&prompt[..1]));
        let mut swapped = prompt.clone();
        swapped.swap(3, 4);
        assert_ne!(d, PromptDigest::of_tokens(&swapped));
        assert_ne!(PromptDigest::of_tokens(&[]), PromptDigest::of_tokens(&[0]));
    }
}
