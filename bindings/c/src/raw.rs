//! The raw-pointer edge: caller memory turned into slices and sized structs, every pointer, length
//! and `struct_size` checked before it is used, and the reinterpretation of `int32` page and
//! token ids. The only other `unsafe` of the crate is in the handles' registry (`handle.rs`:
//! the slots and their holders), the caller's `land` callback (`transfer.rs`), and the import
//! ticket's borrow of its table (`import.rs`). Handles themselves are ids, never dereferenced.

use crate::status::{Failure, kvg_status};
use kvguard::PageId;
use kvguard::config::MAX_PAGES;
use std::mem::{align_of, size_of};

/// The largest `struct_size` accepted: far beyond any version of any struct, so a garbage size
/// (an uninitialised field) is refused instead of read as a huge struct.
pub(crate) const MAX_STRUCT_SIZE: usize = 4096;

// A negative `int32` page id, viewed as `u32`, is at least 2^31: beyond any pool (at most
// `MAX_PAGES` = 2^26 pages), so the table refuses it as `page_out_of_range` and it can never
// name a real page.
const _: () = assert!(MAX_PAGES <= 1 << 31);
const _: () = assert!(size_of::<PageId>() == size_of::<i32>() && align_of::<PageId>() == align_of::<i32>());

/// A C struct that starts with its own size (`size_t struct_size`), so the ABI can grow.
///
/// # Safety
/// The type is `#[repr(C)]`, its first field is the `usize` `struct_size`, and every bit
/// pattern of every field is valid (integers and raw pointers only: no `bool`, no enum).
pub(crate) unsafe trait SizedStruct: Copy {
    /// The smallest `struct_size` a caller may pass: `sizeof` of the first version.
    const MIN_SIZE: usize;
}

fn check_size(size: usize, min: usize) -> Result<(), Failure> {
    if size < min || size > MAX_STRUCT_SIZE {
        return Err(Failure::status(
            kvg_status::BadStructSize,
            format!("struct_size {size} is not in {min}..={MAX_STRUCT_SIZE}"),
        ));
    }
    Ok(())
}

fn check_pointer<T>(ptr: *const T, what: &str) -> Result<(), Failure> {
    if ptr.is_null() {
        return Err(Failure::status(kvg_status::NullPointer, format!("{what} is NULL")));
    }
    if !ptr.is_aligned() {
        return Err(Failure::status(kvg_status::InvalidArgument, format!("{what} is not aligned")));
    }
    Ok(())
}

/// Reads a caller's input struct. `struct_size` below [`SizedStruct::MIN_SIZE`] is refused; one
/// above `sizeof(T)` (a caller built against a newer header) is accepted only when every byte
/// this library does not know is zero, i.e. the caller left the newer fields at their defaults.
pub(crate) fn read_sized<T: SizedStruct>(ptr: *const T, what: &str) -> Result<T, Failure> {
    check_pointer(ptr, what)?;
    // SAFETY: `ptr` is non-null and aligned (checked above) and the caller promises it points to
    // a struct beginning with `size_t struct_size`.
    let size = unsafe { ptr.cast::<usize>().read() };
    check_size(size, T::MIN_SIZE)?;
    if size > size_of::<T>() {
        // SAFETY: the caller's `struct_size` says it owns `size` readable bytes at `ptr`.
        let tail = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>().add(size_of::<T>()), size - size_of::<T>()) };
        if tail.iter().any(|&b| b != 0) {
            return Err(Failure::status(
                kvg_status::BadStructSize,
                format!(
                    "{what}: struct_size {size} sets fields this library does not know (it knows {} bytes)",
                    size_of::<T>()
                ),
            ));
        }
    }
    // SAFETY: at least `size_of::<T>()` bytes are readable (`size >= MIN_SIZE == size_of::<T>()`
    // in this version), the pointer is aligned, and every bit pattern of `T` is valid.
    Ok(unsafe { ptr.read() })
}

/// Writes an output struct into the caller's: at most its `struct_size` bytes (the caller's
/// `struct_size` must be at least [`SizedStruct::MIN_SIZE`]); bytes past `sizeof(T)` are zeroed,
/// and the written `struct_size` says how many bytes this library filled.
pub(crate) fn write_sized<T: SizedStruct>(ptr: *mut T, value: T, what: &str) -> Result<(), Failure> {
    check_pointer(ptr.cast_const(), what)?;
    // SAFETY: non-null and aligned (checked above); the caller set `struct_size` first.
    let size = unsafe { ptr.cast::<usize>().read() };
    check_size(size, T::MIN_SIZE)?;
    // SAFETY: `size` is the caller's own `struct_size`, checked above.
    unsafe { fill(ptr, size, value, size.min(size_of::<T>())) };
    Ok(())
}

/// Fills a caller's struct of `size` bytes (`size` checked here) with `value` and leaves its
/// `struct_size` at `size`: for a struct whose `struct_size` is read again, an input
/// (`kvg_pool_config_init`) or an in-out struct (`kvg_released`). Were it lowered to what this
/// library knows, a newer field the caller sets afterwards would be outside the struct on the
/// next call, and ignored instead of refused.
pub(crate) fn fill_sized<T: SizedStruct>(ptr: *mut T, size: usize, value: T, what: &str) -> Result<(), Failure> {
    check_pointer(ptr.cast_const(), what)?;
    check_size(size, T::MIN_SIZE)?;
    // SAFETY: the caller says it owns `size` writable bytes at `ptr` (checked in range above).
    unsafe { fill(ptr, size, value, size) };
    Ok(())
}

/// Copies the first `min(size, sizeof(T))` bytes of `value`, with `struct_size` set to
/// `struct_size`, to `ptr`, and zeroes the rest of its `size` bytes.
///
/// # Safety
/// `ptr` is non-null, aligned, and `size` bytes at it are writable; `size >= T::MIN_SIZE`.
unsafe fn fill<T: SizedStruct>(ptr: *mut T, size: usize, mut value: T, struct_size: usize) {
    let filled = size.min(size_of::<T>());
    // SAFETY: `struct_size` is the first field of `T` (the trait's contract).
    unsafe { std::ptr::addr_of_mut!(value).cast::<usize>().write(struct_size) };
    // SAFETY: the caller owns `size >= filled` writable bytes at `ptr`; `value` is a local `T` of
    // `size_of::<T>() >= filled` bytes; the two do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(std::ptr::addr_of!(value).cast::<u8>(), ptr.cast::<u8>(), filled);
        std::ptr::write_bytes(ptr.cast::<u8>().add(filled), 0, size - filled);
    }
}

/// A caller's array of `len` elements: NULL is fine only when `len` is 0.
pub(crate) fn slice<'a, T>(ptr: *const T, len: usize, what: &str) -> Result<&'a [T], Failure> {
    if len == 0 {
        return Ok(&[]);
    }
    check_pointer(ptr, what)?;
    if len.checked_mul(size_of::<T>()).is_none_or(|bytes| bytes > isize::MAX as usize) {
        return Err(Failure::status(kvg_status::InvalidArgument, format!("{what}: {len} elements is too many")));
    }
    // SAFETY: non-null, aligned, the byte length fits `isize` (checked above); the caller
    // promises `len` initialised elements that stay unchanged for the call.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// A caller's writable array of `len` elements: NULL is fine only when `len` is 0.
pub(crate) fn slice_mut<'a, T>(ptr: *mut T, len: usize, what: &str) -> Result<&'a mut [T], Failure> {
    if len == 0 {
        return Ok(&mut []);
    }
    slice(ptr.cast_const(), len, what)?;
    // SAFETY: checked as for `slice`; the caller promises `len` writable elements nobody else
    // touches during the call.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
}

/// An engine's `int32` page ids as the table's [`PageId`]s, without copying. A negative id reads
/// as a page of at least 2^31, which no pool has: the table refuses it as `page_out_of_range`.
pub(crate) fn pages(ids: &[i32]) -> &[PageId] {
    // SAFETY: `PageId` is `repr(transparent)` over `u32`, which has the size and alignment of
    // `i32` (asserted above), and every bit pattern is a valid `u32`.
    unsafe { std::slice::from_raw_parts(ids.as_ptr().cast::<PageId>(), ids.len()) }
}

/// An engine's `int32` token ids as the `u32`s the core digests, without copying: each id is read
/// as its 32 bits, the same on every side of a transfer.
pub(crate) fn tokens(ids: &[i32]) -> &[u32] {
    // SAFETY: `u32` and `i32` have the same size and alignment, and every bit pattern is a valid
    // `u32`.
    unsafe { std::slice::from_raw_parts(ids.as_ptr().cast::<u32>(), ids.len()) }
}

/// One `int32` page id as the table's [`PageId`] (negative: beyond any pool, as in [`pages`]).
pub(crate) fn page(id: i32) -> PageId {
    PageId(id as u32)
}

/// Where the first negative entry of `counts` is (the caller's token counts, which must not
/// be): None in one pass the compiler vectorizes (the sign bits OR-ed together) when there is
/// none, the common case; `position` stops at every entry.
pub(crate) fn first_negative(counts: &[i32]) -> Option<usize> {
    if counts.iter().fold(0, |all, &n| all | n) >= 0 {
        return None;
    }
    counts.iter().position(|&n| n < 0)
}

/// Writes `value` through an optional output pointer (NULL: the caller does not want it).
pub(crate) fn put<T>(ptr: *mut T, value: T) -> Result<(), Failure> {
    if ptr.is_null() {
        return Ok(());
    }
    if !ptr.is_aligned() {
        return Err(Failure::status(kvg_status::InvalidArgument, "an output pointer is not aligned".to_string()));
    }
    // SAFETY: non-null and aligned; the caller promises it points to a writable `T`.
    unsafe { ptr.write(value) };
    Ok(())
}

/// Writes `value` through a required output pointer.
pub(crate) fn put_required<T>(ptr: *mut T, value: T, what: &str) -> Result<(), Failure> {
    check_pointer(ptr.cast_const(), what)?;
    put(ptr, value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_page_ids_land_beyond_any_pool() {
        for id in [-1, -2, i32::MIN] {
            assert!(page(id).0 >= MAX_PAGES);
        }
        assert_eq!(pages(&[-1, 0, 7]), &[PageId(u32::MAX), PageId(0), PageId(7)]);
    }
}
