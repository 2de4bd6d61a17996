//! Little-endian fields of the byte formats kvguard reads: the transfer manifest, the device
//! layout (tags, violation records, the ring header) and the ELF headers of a CUBIN.
//!
//! Every reader is bounds-checked: a field that does not lie wholly inside the bytes is `None`,
//! never a panic, so untrusted bytes can be read field by field before their length is believed.

/// The `N` bytes at `at`, if they lie inside `bytes`.
pub(crate) fn bytes_at<const N: usize>(bytes: &[u8], at: usize) -> Option<&[u8; N]> {
    bytes.get(at..)?.first_chunk()
}

/// The little-endian `u16` at `at`.
pub(crate) fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    bytes_at(bytes, at).copied().map(u16::from_le_bytes)
}

/// The little-endian `u32` at `at`.
pub(crate) fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    bytes_at(bytes, at).copied().map(u32::from_le_bytes)
}

/// The little-endian `u64` at `at`.
pub(crate) fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    bytes_at(bytes, at).copied().map(u64::from_le_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_little_endian() {
        let b = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        assert_eq!(u16_at(&b, 0), Some(0x0201));
        assert_eq!(u32_at(&b, 1), Some(0x0504_0302));
        assert_eq!(u64_at(&b, 1), Some(0x0908_0706_0504_0302));
        assert_eq!(bytes_at::<2>(&b, 7), Some(&[8, 9]));
    }

    #[test]
    fn a_field_past_the_end_is_none_whatever_the_offset() {
        let b = [0u8; 8];
        assert_eq!(u64_at(&b, 0), Some(0));
        assert_eq!(u64_at(&b, 1), None);
        assert_eq!(u32_at(&b, 5), None);
        assert_eq!(u16_at(&b, 8), None);
        assert_eq!(u16_at(&b, usize::MAX), None);
        assert_eq!(u32_at(&[], 0), None);
    }
}
